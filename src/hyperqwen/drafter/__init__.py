"""Draft vocabulary for speculative decoding: which token ids the MTP draft head scores.

`vocab` ranks token ids by frequency and cuts a draft vocabulary (the special tokens, then the
most frequent ids), `head` writes the matching rows of the model's lm_head next to it,
`sharegpt` builds the default ranking shipped in `hyperqwen/data`, and `recount` ranks the ids
a running server actually generates, so users can recalibrate for their own traffic.
"""
