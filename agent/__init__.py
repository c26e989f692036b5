"""commlens.agent — the sidecar side: the command line and the demo job."""
