"""What the tests share: tiny models and checkpoints, the fake verifier and live gateway, the
engine and verifier harnesses, the launched stack, and the common fixtures. Tests import
these as `tests.support.*`, never from each other."""
