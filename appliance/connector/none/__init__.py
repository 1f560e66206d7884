"""No connector: colocated engines that prefill and decode themselves."""
