"""Demo data, the embedded S3 server and tiny models: shared by the `rtp` CLI, the benchmarks and the tests."""
