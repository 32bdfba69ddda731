"""natsfs: a FUSE filesystem over NATS JetStream Object Store buckets."""
