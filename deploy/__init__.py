"""The Prometheus rules and the Kubernetes manifests (``kubernetes/``), shipped in the package for
``commlens assets``; ``build.py`` writes the manifests that carry the rules and dashboards."""
