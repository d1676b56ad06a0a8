"""The node agent: what it discovers on its node, and (later) how it reports it.

:mod:`llmgw.agent.model` is the data model every part agrees on: GPU discovery
fills it, the agent's client puts it on the wire, the control plane keeps it.
"""
