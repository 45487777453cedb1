"""A minimal dg project: support tickets routed by a checkpointed asset declared in YAML."""
