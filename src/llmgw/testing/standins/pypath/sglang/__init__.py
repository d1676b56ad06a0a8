"""llmgw's stand-in for SGLang (the simulated engine, not the real one); see llmgw.testing.standins."""

__version__ = "0.0.0+llmgw.standin"
