"""What people read: plots across versions and dashboard export."""
