"""Engine ports and adapters: how the agent drives one inference engine.

`engines.base.Engine` is the port; each adapter lives in its own module
(`engines.sglang.SGLangEngine` speaks SGLang's HTTP API, which the reference engine shares).
"""
