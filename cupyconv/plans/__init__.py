"""Planning launches: the pass table, the kernel families it lists, and the launch mechanics beneath them."""
