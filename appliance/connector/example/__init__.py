"""vLLM's ExampleConnector (KV through shared storage): its plan and argv, settings and simulated flow."""
