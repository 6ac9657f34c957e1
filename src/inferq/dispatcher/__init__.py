"""The dispatcher: reads queues and heartbeats, applies the policy, assigns batches."""
