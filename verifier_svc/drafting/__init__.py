"""The verifier's side of drafting: the pool of drafter replicas, one replica's stream,
and the counting of drafter errors."""
