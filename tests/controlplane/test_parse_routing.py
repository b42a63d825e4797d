"""The generate body's Tether fields: the fast reading of `weight_version` agrees with the
pydantic model on every input, accepting only what the model accepts."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from controlplane.errors import InvalidRequest
from controlplane.proxy import parse_routing, plain_constraint
from store.types import VersionConstraint
from wire import MAX_INT, RoutingFields

values = st.one_of(
    st.none(),
    st.integers(min_value=-5, max_value=MAX_INT + 5),
    st.sampled_from([0, 1, MAX_INT, MAX_INT + 1, -1, True, False, 1.0, 2.5, "3", [], {}]),
)
specs = st.one_of(
    st.dictionaries(
        st.sampled_from(["min_version", "exact_version", "newest"]), values, max_size=3
    ),
    values,
)


@settings(max_examples=400, deadline=None)
@given(spec=specs)
def test_the_fast_reading_accepts_only_what_the_model_accepts_and_agrees_with_it(
    spec: object,
) -> None:
    fast = plain_constraint(spec)
    try:
        model = RoutingFields.model_validate({"weight_version": spec}).weight_version
    except ValidationError:
        assert fast is None
        return
    expected = model.constraint() if model is not None else None
    if fast is not None:
        assert fast == expected


def test_a_body_is_read_the_same_with_or_without_the_fast_path() -> None:
    fields, constraint = parse_routing(b'{"text": "x", "weight_version": {"min_version": 3}}')
    assert constraint == VersionConstraint(min_version=3)
    assert fields.stream is False and fields.run_id is None
    fields, constraint = parse_routing(
        orjson.dumps({"weight_version": {"exact_version": 4}, "stream": True, "run_id": "r"})
    )
    assert constraint == VersionConstraint(exact_version=4)
    assert fields.stream is True and fields.run_id == "r"
    for bad, field in [
        ({"weight_version": {"min_version": True}}, "body.weight_version.min_version"),
        ({"weight_version": {"min_version": 5, "exact_version": 2}}, "body.weight_version"),
        ({"weight_version": {"latest": 1}}, "body.weight_version.latest"),
    ]:
        with pytest.raises(InvalidRequest) as caught:
            parse_routing(orjson.dumps(bad))
        assert caught.value.extra["field"] == field
