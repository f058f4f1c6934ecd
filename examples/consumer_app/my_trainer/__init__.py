"""The consumer's own training package, shipped to the Ray pods by RayWorkload."""
