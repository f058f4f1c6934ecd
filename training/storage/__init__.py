"""Where a run reads and writes: files on local disk or ``s3://`` (:mod:`.files`), the models
and data sets it starts from (:mod:`.sources`, :mod:`.tiny` for the one built on the spot),
and its sharded checkpoints (:mod:`.checkpoint`)."""
