"""The HTTP header names Tether adds to a routed request or its answer.

Plain strings, shared by the router, the engine agent and the clients; no imports.
"""

ENGINE_ID_HEADER = "X-Tether-Engine-Id"
VERSION_START_HEADER = "X-Tether-Weight-Version-Start"
VERSION_END_HEADER = "X-Tether-Weight-Version-End"
SESSION_HEADER = "X-Session-ID"
RUN_HEADER = "X-Tether-Run-Id"
# A session id travels to the engine as a header: printable ASCII, bounded, wherever it
# arrives from (the body's `session_id` or the `X-Session-ID` header).
SESSION_ID_MAX = 512
SESSION_ID_PATTERN = r"^[ -~]*$"
