"""The HTTP header names Tether adds to a routed request or its answer.

Plain strings, shared by the router, the engine agent and the clients; no imports.
"""

ENGINE_ID_HEADER = "X-Tether-Engine-Id"
VERSION_START_HEADER = "X-Tether-Weight-Version-Start"
VERSION_END_HEADER = "X-Tether-Weight-Version-End"
SESSION_HEADER = "X-Session-ID"
RUN_HEADER = "X-Tether-Run-Id"
