"""The REST API of sessions and what it lists: thin DRF views and serializers over the services below."""
