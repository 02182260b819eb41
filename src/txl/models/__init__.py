"""Model families: each architecture's config, model and registry entry."""
