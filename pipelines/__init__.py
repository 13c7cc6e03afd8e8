"""The pipeline wiring, its compilation, the `rtp` command line, and `rtp local`."""
