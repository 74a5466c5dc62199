"""Planning before loading: the memory planner and the precision policies."""
