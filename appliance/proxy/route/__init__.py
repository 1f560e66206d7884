"""The one routing pipeline: where each request goes and why, decided once (router.py: the pass; length.py: the
prompt's length counted by an engine beforehand, where the hand-off depends on it). The policies that pick an
instance of a role are appliance.proxy.policies (one module each, one line in POLICIES); the rules that decide
the route are policies/conditional.py. legs.py serves the decided route and decides nothing.

The interface, kept small for what builds on it: `await Router.routed(facts, count)` (or `Router.route(facts,
counted)` where no count is needed) returns a Route, a context manager that holds the request's bookings;
Unroutable and Refused are its two refusals."""

from appliance.proxy.route.router import Counted, Refused, Route, Router, Unroutable

__all__ = ["Counted", "Refused", "Route", "Router", "Unroutable"]
