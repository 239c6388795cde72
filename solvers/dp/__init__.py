"""The exact dynamic program and what it is made of: the chain of stages it walks
(`chain`), each window's options (`options`, `inner`), the storages pinned across windows
(`pinned`), its bounds on long windows (`bounds`), the schedules its space holds (`space`)
and the search itself (`search.solve`)."""
