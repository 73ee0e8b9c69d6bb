"""The Parquet parts a batch is written to: the writer (`writer`), the checks a batch passes before it is
published (`checks`), reading one layer back sorted (`sorted_layer`), and the array helpers they share
(`bfloat16`, `layer_views`)."""
