"""The output stage: a step's tokens to what callers get (``output_stage``: stop rules, the
incremental detokenizer, reasoning split from answers), ``RequestOutput`` (``outputs``) and the
run's summary (``report``)."""
