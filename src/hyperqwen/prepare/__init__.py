"""`hyperqwen prepare`: from the downloaded W4A16 base to the checkpoint the servers load.

`validate` reads and checks the base, `tensors` requantizes lm_head, embed_tokens and the MTP
linears (streamed, crash-safe), `template` hardens the chat template, `run` puts the steps in
commit order, `folder` owns the folder's layout, lock and atomic writes, `marker` the record of
what was done, `download` the fetch of a missing base, and `cli` the command.
"""
