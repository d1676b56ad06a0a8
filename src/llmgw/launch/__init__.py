"""Replicas the control plane runs: what a node agent is asked to run and what it says back.

:mod:`llmgw.launch.spec` is the contract between the control plane (placement,
deployments) and the node agent (the supervisor and the per-engine launchers).
The control plane sends each node its whole desired set of replicas; the agent
makes it so and reports every replica's state on its heartbeats.
"""
