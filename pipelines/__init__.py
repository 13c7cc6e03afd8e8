"""The pipeline definition: the `@dsl.pipeline` wiring and its platform settings (`rtp_cli` drives it)."""
