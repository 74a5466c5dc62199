"""ember past one machine, on Ray: replicas of the daemon as a Ray Serve application behind one HTTP
ingress, routed by prompt prefix (docs/cluster.md). Needs the `cluster` extra (Ray Serve); nothing
else in ember imports this package."""
