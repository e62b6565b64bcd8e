"""Searching settings: what the recommender tries and ranks, and ``parallel.auto``.

recommend       ``recommend()``: the settings that trade memory for speed
recommendation  what it returns (readable without importing the search)
layouts         [Note: layout search]: which tp x cp layouts, in which order
tracedsearch    which candidates are traced for models the replay cannot plan
stepcost        a relative step cost the recommender ranks by
auto            ``parallel.auto``: the recommendation applied before launch
"""
