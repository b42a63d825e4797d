// The Tether fleet dashboard: polls GET /v1/fleet/overview and draws it. Read-only.
// The token comes from the URL fragment (#token=...) or the login form, lives in this tab's
// sessionStorage, and is only ever sent as a bearer header to this origin; never logged.
"use strict";

const POLL_MS = 1000;
const COLORS = { bf16: "#2d5bd7", fp8: "#d9822b", nvfp4: "#1f8a4c" };
const $ = (id) => document.getElementById(id);
const view = { data: null, run: null, sort: { key: "engine_id", dir: 1 }, builtAt: null };

function esc(value) {
  return String(value ?? "").replace(/[&<>"']/g, (c) => ({
    "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;",
  })[c]);
}
const v = (x) => (x === null || x === undefined ? "—" : "v" + x);
function secs(s) {
  if (s === null || s === undefined) return "—";
  if (s < 1) return (s * 1000).toFixed(0) + " ms";
  if (s < 120) return s.toFixed(1) + " s";
  if (s < 7200) return (s / 60).toFixed(1) + " min";
  return (s / 3600).toFixed(1) + " h";
}
const rate = (x) => (x < 0.05 ? x.toFixed(3) : x.toFixed(2)) + "/s";
const num = (x, d = 3) => (x === null || x === undefined ? "—" : Number(x).toFixed(d));

// ------------------------------------------------------------------ token

function takeToken() {
  const m = location.hash.match(/token=([^&]+)/);
  if (m) {
    sessionStorage.setItem("tether-token", decodeURIComponent(m[1]));
    // Drop it from the address bar and history so it is not shared by copy-paste.
    history.replaceState(null, "", location.pathname + location.search);
  }
  return sessionStorage.getItem("tether-token");
}

function showLogin(message) {
  $("main").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  setStatus("signed out", "down");
}

function setStatus(text, kind) {
  const el = $("status");
  el.textContent = text;
  el.className = "status " + (kind || "");
}

// ------------------------------------------------------------------ polling

async function poll() {
  const token = sessionStorage.getItem("tether-token");
  if (!token) return showLogin();
  try {
    const reply = await fetch("/v1/fleet/overview", {
      headers: { Authorization: "Bearer " + token }, cache: "no-store",
    });
    if (reply.status === 401 || reply.status === 403) {
      sessionStorage.removeItem("tether-token");
      const body = await reply.json().catch(() => ({}));
      return showLogin((body.error && body.error.message) || "the token was refused");
    }
    if (!reply.ok) throw new Error("HTTP " + reply.status);
    const data = await reply.json();
    $("login").hidden = true;
    $("main").hidden = false;
    if (data.built_at !== view.builtAt) {
      view.builtAt = data.built_at;
      view.data = data;
      render();
    }
    setStatus("live · snapshot " + new Date(data.built_at * 1000).toLocaleTimeString(), "live");
  } catch (err) {
    setStatus("cannot reach the control plane (" + err.message + "); retrying", "down");
  }
  setTimeout(poll, document.hidden ? POLL_MS * 5 : POLL_MS);
}

// ------------------------------------------------------------------ drawing

function currentRun(data) {
  const ids = data.runs.map((r) => r.run_id);
  const select = $("run");
  if (select.dataset.ids !== ids.join(",")) {
    select.dataset.ids = ids.join(",");
    select.innerHTML = ids.map((id) => `<option>${esc(id)}</option>`).join("");
    if (view.run && ids.includes(view.run)) select.value = view.run;
  }
  view.run = select.value || ids[ids.length - 1] || null;
  return data.runs.find((r) => r.run_id === view.run) || null;
}

function render() {
  const data = view.data;
  const run = currentRun(data);
  const engines = data.engines.filter((e) => !run || e.run_id === run.run_id);
  const precisions = data.precisions.filter((p) => !run || p.run_id === run.run_id);
  $("latest").textContent = run ? "latest " + v(run.latest_version) + " · " + run.policy : "no run";
  drawRates(data, run, engines);
  drawPrecisions(precisions, run);
  drawTimeline(run);
  drawGap(run);
  fillOptions($("f-precision"), precisions.map((p) => p.precision), "all precisions");
  fillOptions($("f-state"), data.states, "all states");
  drawEngines(engines);
}

function fillOptions(select, values, all) {
  const key = values.join(",");
  if (select.dataset.values === key) return;
  const keep = select.value;
  select.dataset.values = key;
  select.innerHTML = `<option value="">${all}</option>` +
    values.map((x) => `<option>${esc(x)}</option>`).join("");
  if (values.includes(keep)) select.value = keep;
}

function card(value, label, id, detail) {
  const more = detail ? `<small>${esc(detail)}</small>` : "";
  return `<div class="card" id="${id}"><b>${esc(value)}</b><span>${esc(label)}</span>${more}</div>`;
}

// "reason 1.2/s, other 0.1/s": where the 409s and retries come from.
const byReason = (rates) => Object.entries(rates || {}).sort((a, b) => b[1] - a[1])
  .map(([reason, r]) => `${reason} ${rate(r)}`).join(", ");

function drawRates(data, run, engines) {
  const r = data.rates;
  const last = run && run.gap.length ? run.gap[run.gap.length - 1] : null;
  const serving = engines.filter((e) => e.sync_state === "ready" || e.sync_state === "syncing");
  const onLatest = serving.filter((e) => run && e.applied_version === run.latest_version).length;
  $("rates").innerHTML = [
    card(engines.length, "engines", "card-engines"),
    card(serving.length ? Math.round((100 * onLatest) / serving.length) + "%" : "—",
      "serving the latest", "card-latest"),
    card(rate(r.not_ready_per_s), "409 not ready", "card-409", byReason(r.not_ready_by_reason)),
    card(rate(r.retries_per_s), "engine retries", "card-retries", byReason(r.retries_by_reason)),
    card(rate(r.requests_per_s), "requests", "card-requests"),
    card(last && last.staleness_mean !== null ? num(last.staleness_mean, 2) : "—",
      "rollout staleness (mean)", "card-staleness"),
    card(last && last.staleness_max !== null ? last.staleness_max : "—",
      "rollout staleness (max)", "card-staleness-max"),
  ].join("");
}

function drawPrecisions(rows, run) {
  const last = run && run.gap.length ? run.gap[run.gap.length - 1] : null;
  $("precisions").tBodies[0].innerHTML = rows.map((p) => {
    const states = Object.entries(p.states).map(([s, n]) =>
      `<span class="state-${esc(s)}">${esc(s)} ${n}</span>`).join(" ");
    const versions = Object.entries(p.versions).map(([ver, n]) =>
      `${ver === "none" ? "—" : "v" + esc(ver)}×${n}`).join(" ");
    const gap = last && last.precisions[p.precision];
    return `<tr data-precision="${esc(p.precision)}"><td>${esc(p.precision)}</td>` +
      `<td class="num">${p.engines}</td><td class="num">${p.serving}</td><td>${states}</td>` +
      `<td>${versions}</td><td class="num">${num(p.lag_mean, 2)} / ${p.lag_max ?? "—"}</td>` +
      `<td class="num">${p.in_flight}</td><td class="num">${gap ? num(gap.k3_kl, 4) : "—"}</td></tr>`;
  }).join("");
}

function drawTimeline(run) {
  const rows = run ? run.timeline.slice().reverse() : [];
  const now = view.data.built_at;
  $("timeline").tBodies[0].innerHTML = rows.map((t) => {
    const mark = t.upper_bound ? " ≤" : "";
    return `<tr data-version="${t.version}"><td>${v(t.version)}</td>` +
      `<td>${secs(now - t.published_at)} ago</td>` +
      `<td><progress max="1" value="${t.serving_fraction}"></progress> ` +
      `${Math.round(100 * t.serving_fraction)}%</td>` +
      `<td class="num">${t.t50_s === null ? "—" : mark + secs(t.t50_s)}</td>` +
      `<td class="num">${t.t90_s === null ? "—" : mark + secs(t.t90_s)}</td>` +
      `<td class="num">${t.t100_s === null ? "—" : mark + secs(t.t100_s)}</td></tr>`;
  }).join("") || `<tr><td colspan="6" class="muted">no version published yet</td></tr>`;
}

function drawGap(run) {
  const box = $("gap");
  const steps = run ? run.gap : [];
  if (!steps.length) {
    box.innerHTML = `<p class="muted">no gap reports yet (the trainer sends them with ` +
      `<code>RolloutClient.report_gap</code>)</p>`;
    return;
  }
  const names = [...new Set(steps.flatMap((s) => Object.keys(s.precisions)))];
  const w = 420, h = 110, pad = 4;
  const values = steps.flatMap((s) => Object.values(s.precisions).map((g) => g.k3_kl));
  const top = Math.max(1e-9, ...values);
  const x = (i) => pad + (i * (w - 2 * pad)) / Math.max(1, steps.length - 1);
  const y = (k) => h - pad - (k / top) * (h - 2 * pad);
  const lines = names.map((p) => {
    const pts = steps.map((s, i) => (s.precisions[p] ? `${x(i)},${y(s.precisions[p].k3_kl)}` : null))
      .filter(Boolean).join(" ");
    return `<polyline points="${pts}" stroke="${COLORS[p] || "#555"}"></polyline>`;
  }).join("");
  const legend = names.map((p) => `<svg width="10" height="10"><rect width="10" height="10" ` +
    `fill="${COLORS[p] || "#555"}"></rect></svg> ${esc(p)}`).join(" &nbsp; ");
  const last = steps[steps.length - 1];
  const rows = names.map((p) => {
    const g = last.precisions[p];
    return g ? `<tr data-precision="${esc(p)}"><td>${esc(p)}</td><td class="num">${num(g.k3_kl, 4)}</td>` +
      `<td class="num">${num(g.logprob_abs_diff, 4)}</td><td class="num">${num(g.masked_fraction, 3)}</td>` +
      `<td class="num">${g.tokens}</td></tr>` : "";
  }).join("");
  box.innerHTML = `<div>k3 KL(sampler ‖ trainer) by step, max ${num(top, 4)} · ${legend}</div>` +
    `<svg class="spark" width="${w}" height="${h}" viewBox="0 0 ${w} ${h}">` +
    `<rect width="${w}" height="${h}" fill="#fff" stroke="#dedee3"></rect>${lines}</svg>` +
    `<table class="grid" id="gap-table"><thead><tr><th>step ${last.step}` +
    ` (trainer ${v(last.trainer_version)})</th><th>k3</th><th>|Δ log p|</th><th>MIS masked</th>` +
    `<th>tokens</th></tr></thead><tbody>${rows}</tbody></table>`;
}

function compare(key) {
  return (a, b) => {
    const x = a[key], y = b[key];
    if (x === y) return a.engine_id < b.engine_id ? -1 : 1;
    if (x === null || x === undefined) return 1;
    if (y === null || y === undefined) return -1;
    return (x < y ? -1 : 1) * view.sort.dir;
  };
}

const labelList = (e) => Object.entries(e.labels || {}).map(([k, x]) => `${k}=${x}`);

function drawEngines(all) {
  const text = $("filter").value.trim().toLowerCase();
  const precision = $("f-precision").value;
  const state = $("f-state").value;
  const behind = $("f-behind").checked;
  const rows = all.filter((e) =>
    (!precision || e.precision === precision) && (!state || e.sync_state === state) &&
    (!behind || (e.target_version !== null && e.applied_version !== e.target_version)) &&
    (!text || [e.engine_id, e.url, e.kind, e.accelerator, e.last_error, e.precision, e.sync_state,
      ...labelList(e)].some((f) => f && String(f).toLowerCase().includes(text))));
  rows.sort(compare(view.sort.key));
  $("shown").textContent = `(${rows.length} of ${all.length})`;
  for (const th of $("engines").tHead.rows[0].cells) {
    th.className = th.dataset.key === view.sort.key ? (view.sort.dir > 0 ? "asc" : "desc") : "";
  }
  $("engines").tBodies[0].innerHTML = rows.map((e) => {
    const staging = e.staging_target === null ? "—" :
      `${v(e.staging_target)} <progress max="1" value="${e.staging_progress}"></progress> ` +
      `${Math.round(100 * e.staging_progress)}%`;
    const late = e.target_version !== null && e.applied_version !== e.target_version
      ? " behind" : "";
    const tip = [e.url, ...labelList(e), e.last_error].filter(Boolean).join("\n");
    return `<tr data-engine-id="${esc(e.engine_id)}" class="${late}" title="${esc(tip)}">` +
      `<td class="id">${esc(e.engine_id.slice(0, 12))}</td><td>${esc(e.precision)}</td>` +
      `<td>${esc(e.accelerator)}</td><td>${esc(e.kind || "—")}</td>` +
      `<td class="num served">${v(e.applied_version)}</td><td class="num target">${v(e.target_version)}</td>` +
      `<td class="state state-${esc(e.sync_state)}">${esc(e.sync_state)}</td><td>${staging}</td>` +
      `<td class="num">${e.in_flight}/${e.capacity}</td><td class="num">${secs(e.heartbeat_age_s)}</td></tr>`;
  }).join("");
}

// ------------------------------------------------------------------ wiring

document.addEventListener("DOMContentLoaded", () => {
  $("login").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const value = $("token").value.trim();
    $("token").value = "";
    if (value) sessionStorage.setItem("tether-token", value);
    setStatus("connecting…");
    poll();
  });
  $("run").addEventListener("change", () => { view.run = $("run").value; if (view.data) render(); });
  for (const id of ["filter", "f-precision", "f-state", "f-behind"]) {
    $(id).addEventListener("input", () => view.data && render());
  }
  $("engines").tHead.addEventListener("click", (ev) => {
    const key = ev.target.dataset && ev.target.dataset.key;
    if (!key) return;
    view.sort = { key, dir: view.sort.key === key ? -view.sort.dir : 1 };
    if (view.data) render();
  });
  if (takeToken()) poll(); else showLogin();
});
