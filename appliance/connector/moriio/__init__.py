"""AMD MORI-IO (vLLM's MoRIIOConnector): its plan and argv, settings, peer addresses, proxy registration and
simulated flow."""
