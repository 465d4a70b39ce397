"""Files local and gs://: paths, atomic writes, appends, object generations, Parquet."""
