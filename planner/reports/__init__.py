"""What people read of a plan: its plots (`viz`) and a self-contained HTML page (`report`)."""
