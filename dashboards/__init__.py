"""The Grafana dashboards (``*.json``), shipped in the package for ``commlens assets``; ``build.py``
writes them."""
