"""Running Graphviz: one bounded layout process per candidate, the size/cost estimate before it, crash retries."""
