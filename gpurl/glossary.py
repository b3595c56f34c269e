"""Shape letters: the suffix of an array's name lists its axes, `logits_BxTxV`.

Every module of gpurl names arrays with these letters, and each letter means one thing
everywhere (tests/test_glossary.py reads every name in gpurl/ and checks it). The glossary
keeps the letters that several modules use; a letter that one module alone uses is
declared in that module's docstring, on a line of its own,
`Shape letter R: rotary frequencies of a head (E / 2).`, and means that only there.
Digits are literal sizes (`scores_Px2`: chosen, rejected; `last_Bx1`), and `N1` is N + 1
(the states before each of N tokens and after the last). A per-shard function's B is
that shard's rows.

    B  batch rows: sequences of a batch or of a shard (B = P x G in grouped batches), or
       the packed rows of an RL or preference step
    T  token positions of a sequence; the query tokens of attention
    S  key/value slots: the keys attention reads, the slots of a KV cache
    D  model width (d_model)
    E  width of one attention head (head_dim)
    H  query heads
    K  key/value heads (H % K == 0)
    Q  query heads that share one key/value head (H / K)
    F  hidden width of the MLP (mlp_dim)
    V  vocabulary
    L  decoder layers (in routing replay's arrays: the sparse layers)
    P  prompts of a grouped batch: RL groups, preference pairs
    G  completions per prompt (GRPO's group; the k samples of pass@k)
    N  completion token slots (rollout.max_new_tokens)
    W  width of a padded prompt
    C  tokens of a chunk of each row (chunked log-probs; a packed row's slots that
       predict completion tokens)
    J  chunks
    X  examples of a dataset
    Z  the tokens of many examples or sequences, one after another (packing: the slots of
       a packed row)
    A  data shards of the rollout mesh (a paged KV pool has one part per shard)
    Y  blocks of a paged KV pool
    U  token slots of one KV block
    I  entries of a block table: the blocks one row may hold
    O  experts of a mixture-of-experts layer (a token's top-k of them has no letter: those
       arrays are named without a suffix, their shape in the docstring)
    M  micro-batches of a train step
"""

LETTERS = {
    "B": "batch rows", "T": "token positions", "S": "key/value slots", "D": "model width",
    "E": "head width", "H": "query heads", "K": "key/value heads", "Q": "query heads per kv head",
    "F": "MLP width", "V": "vocabulary", "L": "layers",
    "P": "prompts", "G": "completions per prompt", "N": "completion slots",
    "W": "prompt width", "C": "chunk tokens",
    "J": "chunks", "X": "examples", "Z": "concatenated tokens",
    "A": "data shards", "Y": "KV pool blocks", "U": "tokens per KV block", "I": "block-table entries",
    "O": "experts", "M": "micro-batches",
}
