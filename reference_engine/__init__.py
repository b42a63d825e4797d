"""The CPU reference engine: SGLang's HTTP subset over a Hugging Face model on CPU.

Start one with `tether engine reference --model DIR --port N`, or `serve(settings)`.
"""

from reference_engine.settings import ReferenceEngineSettings

__all__ = ["ReferenceEngineSettings"]
