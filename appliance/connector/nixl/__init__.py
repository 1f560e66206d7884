"""NVIDIA NIXL (vLLM's NixlConnector / NixlPushConnector): its plan and argv, settings and simulated flow."""
