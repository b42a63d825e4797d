"""Running the reference engine as a process: uvicorn on the configured host and port.

Owns process-level wiring only (logging, uvicorn). The model loads in the app's startup,
so the port answers only once the engine can serve. Must never hold engine state.
"""

from __future__ import annotations

import logging

from reference_engine.settings import ReferenceEngineSettings


def serve(settings: ReferenceEngineSettings) -> None:
    """Load `settings.model_path`, then serve it until the process is stopped.

    Raises `PrecisionMismatch` or `FileNotFoundError` before any port opens.
    """
    import uvicorn

    from reference_engine.app import create_app
    from reference_engine.engine import ReferenceEngine

    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Build before uvicorn starts, so a bad checkpoint is a clean error, not a failed lifespan.
    engine = ReferenceEngine(settings)
    uvicorn.run(
        create_app(settings, engine),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
    )
