"""The control plane: node agents register with it over gRPC and report their GPUs.

* :mod:`.nodes`: the node map (plain data, no I/O; the clock is injected).
* :mod:`.service`: the gRPC service and the :class:`~.service.ControlPlane` component.
* :mod:`.collector`: the cluster's families on the admin ``/metrics``, computed per scrape.
* :mod:`.views`: nodes and GPUs as the management API shows them.
"""
