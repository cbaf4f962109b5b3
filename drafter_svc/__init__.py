"""specdec drafter service: one proposer per stream, served over gRPC."""
