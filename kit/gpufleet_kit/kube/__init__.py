"""The only place that talks to the Kubernetes API: configuration, the async client, errors."""
