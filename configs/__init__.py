"""The packaged job configs (one YAML file per runnable job); rollout.config_loader finds them by name."""
