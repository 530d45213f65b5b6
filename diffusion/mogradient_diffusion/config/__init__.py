"""A run's configuration: typed sections, YAML loading with overrides, early checks."""
