"""Multi-agent particle environments (Lowe et al., 2017; Mordatch & Abbeel, 2018) with the
original MPE physics, in the JaxMARL dict-per-agent convention."""
