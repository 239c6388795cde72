"""Pipeline parallelism: a stage's step under its schedule (`stage`), a rank of several
stages (`rank`), the split of a model into stages (`split`) and torch's split backward
(`split_backward`)."""
