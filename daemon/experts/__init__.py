"""Mixture-of-experts layers: the routed feed-forward, routing statistics, hot/cold placement, and the CPU worker processes that compute cold experts."""
