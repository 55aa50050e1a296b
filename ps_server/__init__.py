"""Parameter-server side: the shard service and the coordinator service."""
