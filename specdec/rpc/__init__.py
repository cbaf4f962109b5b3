"""What the gRPC services share: server helpers, TLS, the internal token, the tensor codec,
the mapping of errors to status codes and the malformed-request interceptor."""
