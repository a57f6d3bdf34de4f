// megamoe C API: no PyTorch types, so one native build serves every framework version.
//
// Every function returns MEGAMOE_OK or an error code; megamoe_last_error() then holds a message
// for the calling thread. Device pointers are raw CUDA allocations owned by the caller.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MEGAMOE_OK 0
#define MEGAMOE_ERROR_INVALID_ARGUMENT 1
#define MEGAMOE_ERROR_CUDA 2
#define MEGAMOE_ERROR_TIMEOUT 3  // a peer rank did not arrive in time (megamoe_barrier_check)

// Rows of the expert-major pool are grouped in blocks of this many; each expert is padded to it.
#define MEGAMOE_BLOCK_M 128

const char* megamoe_last_error(void);

// ---------------------------------------------------------------------------------------------
// Routing: topk_ids [T, K] (global expert ids, -1 = masked) -> an expert-major pool plan for the
// experts [expert_begin, expert_begin + num_local_experts). Routes to other experts get slot -1.
// Within an expert, rows keep route order (t * K + k ascending), so the plan is deterministic.
// ---------------------------------------------------------------------------------------------
typedef struct {
  int64_t num_tokens;         // T >= 0
  int32_t top_k;              // K >= 1
  int32_t num_experts;        // E, global
  int32_t expert_begin;       // first local expert
  int32_t num_local_experts;  // E_local >= 1
} megamoe_routing_shape;

typedef struct {
  int32_t* expert_counts;   // [E_local]      routes per local expert
  int32_t* expert_offsets;  // [E_local + 1]  first pool row of each expert; multiples of BLOCK_M
  int32_t* compact_offsets; // [E_local + 1]  first row of each expert without padding rows (prefix
                            //                sums of expert_counts): the rows of GEMM1's z
  int32_t* route_to_slot;   // [T * K]        pool row of route t * K + k, or -1
  int32_t* slot_to_route;   // [capacity]     route of each pool row, -1 for padding rows
  int32_t* block_expert;    // [max_blocks]   local expert of pool block b (rows b*128 .. b*128+127)
  int32_t* num_blocks;      // [1]            blocks in use
  int32_t* num_invalid;     // [1]            routes whose id is outside [-1, E): treated as masked
  void* workspace;          // megamoe_routing_workspace_bytes() bytes (may be 0: then null); device plans only
  megamoe_routing_shape shape;  // what the plan is built for: set before building, read by every consumer
  int32_t* num_invalid_host;  // optional: host memory the device writes (pinned): the build writes
                              // num_invalid here too, so the host reads it without a copy
} megamoe_routing_plan;

// Pool rows the plan can need in the worst case (every expert adds at most BLOCK_M - 1 padding rows).
int64_t megamoe_routing_capacity(const megamoe_routing_shape* shape);
int64_t megamoe_routing_max_blocks(const megamoe_routing_shape* shape);
size_t megamoe_routing_workspace_bytes(const megamoe_routing_shape* shape);

// topk_ids holds int32 (id_bytes 4) or int64 (id_bytes 8) ids; an int64 id outside [-1, E) is
// counted in num_invalid like any other, never narrowed onto an expert.
// GPU plan for plan->shape, enqueued on `stream` (a cudaStream_t); does not synchronise.
int megamoe_build_routing_cuda(const void* topk_ids, int32_t id_bytes, const megamoe_routing_plan* plan, void* stream);

// Host reference with the same outputs (plan->workspace is unused).
int megamoe_build_routing_host(const void* topk_ids, int32_t id_bytes, const megamoe_routing_plan* plan);

// ---------------------------------------------------------------------------------------------
// Every entry point below that works on a pool takes the routing plan it was built from (device
// arrays plus its shape: T = shape.num_tokens, K = shape.top_k, E_local = shape.num_local_experts,
// max_blocks = megamoe_routing_max_blocks(&shape)) and one small struct of its own arguments.
// A null pointer in an argument struct is an error unless the field says it may be null.
// ---------------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------
// Dispatch and combine on one rank. Dispatch copies rows of any element type (row_bytes a multiple
// of 16: bf16 activations, e4m3 activations, their fp32 scales); combine sums bf16 rows.
// dispatch: pool[route_to_slot[t, k]] = x[t] for every route with a slot; the padding rows of the
//           live blocks (r < 128 * *num_blocks, slot_to_route[r] < 0) are zeroed, rows past the
//           live blocks are not touched. Walks tokens, so each row of x is read once. With weights,
//           also weights_pool[slot] = weights[t, k] the same way (0 on padding rows). With weights,
//           x and pool may both be null (row_bytes 0): the weights alone, for GEMMs that read the
//           rows by route themselves.
// combine:  y[t] = Σ_k topk_weights[t, k] · routed[t * K + k] over routes with route_to_slot >= 0,
//           in ascending k, fp32, rounded once (deterministic); null topk_weights: every weight 1.
// ---------------------------------------------------------------------------------------------
typedef struct {
  const void* x;         // [T, row_bytes], rows x_stride bytes apart; null only with pool
  void* pool;            // [max_blocks * 128, row_bytes]; null only with x (the weights alone)
  const float* weights;  // [T, K] fp32, or null (then weights_pool is null too)
  float* weights_pool;   // [max_blocks * 128] fp32, or null
  int32_t row_bytes;     // a positive multiple of 16 (bf16: 2 * hidden); 0 without rows
  int32_t x_stride;      // 0: row_bytes; else a multiple of 16 no smaller (columns of a wider x)
} megamoe_dispatch_args;

typedef struct {
  const void* routed;         // [T * K, hidden] bf16, row t * K + k
  const float* topk_weights;  // [T, K] fp32, or null: every weight 1
  void* y;                    // [T, hidden] bf16
  int32_t hidden;             // a multiple of 8
} megamoe_combine_args;

int megamoe_dispatch_bf16(const megamoe_routing_plan* plan, const megamoe_dispatch_args* args, void* stream);
int megamoe_combine_bf16(const megamoe_routing_plan* plan, const megamoe_combine_args* args, void* stream);

// dispatch_fp8: the dispatch of bf16 rows quantised once per token on the way (the recipe of
// megamoe_quantize_rows_fp8, 1 x 128 blocks): pool[slot] = x[t] in e4m3, pool_scales[b, slot] = the
// scale of block b of x[t]; the padding rows of the live blocks get zeros and scale 0, rows past the
// live blocks are not touched. The same bytes as quantising x, then dispatching its rows and scales.
// With weights, weights_pool[slot] = the route's weight, 0 on padding rows (the backward's p, as
// megamoe_dispatch_bf16 dispatches it beside dy's rows). With rows, each token's quantised row is
// stored once more in token order: rows[t] and row_scales[b, t], what megamoe_quantize_rows_fp8
// makes of x.
typedef struct {
  const void* x;        // [T, hidden] bf16
  void* pool;           // [max_blocks * 128, hidden] e4m3
  float* pool_scales;   // [hidden / 128, max_blocks * 128] fp32, the layout the FP8 GEMMs read
  int32_t hidden;       // a multiple of 128
  const float* weights; // [T, K] fp32, or null (then weights_pool is null too)
  float* weights_pool;  // [max_blocks * 128] fp32, or null
  void* rows;           // [T, hidden] e4m3, or null (then row_scales is null too)
  float* row_scales;    // [hidden / 128, T] fp32, or null
} megamoe_dispatch_fp8_args;

int megamoe_dispatch_fp8(const megamoe_routing_plan* plan, const megamoe_dispatch_fp8_args* args, void* stream);

// ---------------------------------------------------------------------------------------------
// Dispatch and combine over W <= MEGAMOE_MAX_PEERS ranks (expert parallelism), pull model. Routes
// are numbered globally, rank by rank: rank r's route t * K + k is route_offsets[r] + t * K + k
// (route_offsets [W + 1], host array, route_offsets[0] = 0, rank r has (route_offsets[r + 1] -
// route_offsets[r]) / K tokens). An owner's plan is megamoe_build_routing over every rank's topk_ids
// (concatenated in rank order) and its own experts. Peer tables are host arrays of W device
// pointers valid on this device: peer memory (NVLink), or other buffers of the same device for W
// virtual ranks on one GPU.
// dispatch_peers (on the experts' owner, with its plan): pool rows of the live blocks: row s =
//           x_peers[r][t] for its route (r, t, k) = slot_to_route[s], zeros on padding rows; rows past
//           the live blocks untouched. With weights_peers, weights_pool[s] = the route's weight the same way.
// combine_peers (on the tokens' rank; reads the owners' tables, no plan of its own): y[t] =
//           Σ_k topk_weights[t, k] · out_peers[d][slot] where d is the rank whose plan gives global route
//           route_offset + t * K + k a slot (route_to_slot_peers[d][route] >= 0; none: the route is
//           masked and adds nothing), in ascending k, fp32, rounded once: bit for bit
//           megamoe_combine_bf16's sums (null topk_weights: every weight 1). out_peers[d] is rank d's
//           pool-ordered output [pool rows, hidden].
// ---------------------------------------------------------------------------------------------
#define MEGAMOE_MAX_PEERS 8

typedef struct {
  const void* const* x_peers;          // [W] -> [T_r, row_bytes]
  const int64_t* route_offsets;        // [W + 1], host
  const float* const* weights_peers;   // [W] -> [T_r, K] fp32, or null (then weights_pool is null too)
  void* pool;                          // [max_blocks * 128, row_bytes]
  float* weights_pool;                 // [max_blocks * 128] fp32, or null
  int32_t world;
  int32_t row_bytes;                   // a multiple of 16 (bf16: 2 * hidden)
} megamoe_dispatch_peers_args;

typedef struct {
  const void* const* out_peers;                // [W] -> [pool rows of rank d, hidden] bf16
  const int32_t* const* route_to_slot_peers;   // [W] -> every owner's route -> slot table over all routes
  const float* topk_weights;                   // [T, K] fp32 of this rank, or null: every weight 1
  void* y;                                     // [T, hidden] bf16
  int64_t route_offset;                        // this rank's first global route
  int64_t num_tokens;                          // T of this rank
  int32_t top_k;
  int32_t world;
  int32_t hidden;                              // a multiple of 8
} megamoe_combine_peers_args;

int megamoe_dispatch_peers_bf16(const megamoe_routing_plan* plan, const megamoe_dispatch_peers_args* args,
                                void* stream);
int megamoe_combine_peers_bf16(const megamoe_combine_peers_args* args, void* stream);

// ---------------------------------------------------------------------------------------------
// Barrier across the W ranks of an expert-parallel group, with a timeout. Each rank owns an int32
// signal array [W], zero before the first call, in memory all ranks can write (symmetric memory;
// buffers of one device for virtual ranks); signal_peers (host array of W device pointers) holds
// every rank's array. megamoe_barrier stores epoch into every rank's signal for `rank`, then waits
// until every rank's signal in its own array reaches epoch: epochs start at 1 and grow by call. It
// never hangs: after timeout_ns it stops waiting and status (device int32 [2]) says {phase, 1 + the
// first rank that did not arrive}; {0, 0} when all did. After synchronising, megamoe_barrier_check
// on a host copy of status returns MEGAMOE_OK or MEGAMOE_ERROR_TIMEOUT with a message naming the
// rank and the phase (phase >= 1 numbers the caller's phases: dispatch, combine, ...).
// ---------------------------------------------------------------------------------------------
int megamoe_barrier(void* const* signal_peers, int32_t world, int32_t rank, int32_t epoch, int32_t phase,
                    int64_t timeout_ns, int32_t* status, void* stream);
int megamoe_barrier_check(const int32_t* status, int32_t rank, int64_t timeout_ns);

// Lets kernels on the current device dereference pointers into peer_device's memory: MEGAMOE_OK when
// already on or peer_device is this device; MEGAMOE_ERROR_INVALID_ARGUMENT, with the reason, when the
// two GPUs have no peer-to-peer path.
int megamoe_enable_peer_access(int32_t peer_device);

// Shared memory of an expert-parallel group. megamoe_shared_alloc allocates `bytes` on `device` (a
// cudaMalloc of its own) and writes its CUDA IPC handle (MEGAMOE_IPC_HANDLE_BYTES) for the other
// ranks; megamoe_shared_open, in another process, maps that memory into `device`'s address space (the
// caller's own GPU, so that its kernels can read and write it). Each mapping is closed with
// megamoe_shared_close and each allocation freed with megamoe_shared_free, on the same device.
#define MEGAMOE_IPC_HANDLE_BYTES 64
int megamoe_shared_alloc(int32_t device, int64_t bytes, void** ptr, void* ipc_handle);
int megamoe_shared_free(int32_t device, void* ptr);
int megamoe_shared_open(int32_t device, const void* ipc_handle, void** ptr);
int megamoe_shared_close(int32_t device, void* ptr);
// Copies `bytes` between any two device pointers (a peer's mapped memory included), queued on `stream`.
int megamoe_copy_async(void* dst, const void* src, int64_t bytes, void* stream);

// ---------------------------------------------------------------------------------------------
// Grouped GEMM over a routing plan's expert-major pool (persistent, warp-specialised, sm_90a).
// For every block b < *num_blocks with local expert e = block_expert[b]:
//   C[128 b : 128 b + 128, :] = A[128 b : 128 b + 128, :] · B[e]ᵀ
// A [max_blocks * 128, K] bf16 row-major; B [E_local, N, K] bf16 row-major (nn.Linear layout);
// C [max_blocks * 128, N] bf16 row-major. num_blocks is read on the device (no host sync).
// N and K must be multiples of 8 (16-byte rows; the last tiles stop at N and K, docs/DESIGN.md);
// every pointer 16-byte aligned.
// ---------------------------------------------------------------------------------------------
typedef struct {
  const void* a;
  const void* b;
  void* c;
  int32_t n;
  int32_t k;
} megamoe_gemm_args;

int megamoe_grouped_gemm_bf16(const megamoe_routing_plan* plan, const megamoe_gemm_args* args, void* stream);

// ---------------------------------------------------------------------------------------------
// The same grouped GEMM in block FP8 (DeepSeek-V3 recipe): for every block b < *num_blocks with
// local expert e = block_expert[b], row r of it and column c,
//   C[r, c] = sum over k-blocks j of a_scales[j, r] * b_scales[e, c / 128, j] * (A[r, 128 j :] · B[e][c, 128 j :])
// with each k-block's products summed in fp32 by the tensor cores, the scaled sum in fp32, one
// bf16 rounding. A [max_blocks * 128, K] e4m3 row-major; a_scales [K / 128, max_blocks * 128] fp32
// (k-block major); B [E_local, N, K] e4m3 row-major; b_scales [E_local, N / 128, K / 128] fp32;
// C [max_blocks * 128, N] bf16. N and K must be multiples of 128.
// ---------------------------------------------------------------------------------------------
typedef struct {
  const void* a;
  const float* a_scales;
  const void* b;
  const float* b_scales;
  void* c;
  int32_t n;
  int32_t k;
} megamoe_gemm_fp8_args;

int megamoe_grouped_gemm_fp8(const megamoe_routing_plan* plan, const megamoe_gemm_fp8_args* args, void* stream);

// ---------------------------------------------------------------------------------------------
// Block-FP8 quantisation of bf16 rows (the activations' 1 x 128 recipe): per row and 128 columns,
// scale = amax / 448 (1 for an all-zero block, NaN for a block holding a NaN), q = a · (1 / scale) in
// e4m3 (nearest even, saturating). scales: k-block major [k / 128, rows] (scales_ld = 0: the layout
// the FP8 GEMMs read) or row major [rows, scales_ld] (scales_ld >= k / 128; columns past k / 128
// untouched); a 16-byte and q 8-byte aligned. Dequantisation: a = q · scale rounded to bf16, scales
// k-block major; a 8-byte and q 4-byte aligned.
// megamoe_quantize_blocks_fp8: the weights' recipe on the same arguments, one scale per 128 x 128
// block: rows a multiple of 128 (E·N for weights [E, N, K]), scales [rows / 128, k / 128] row major
// (scales_ld 0), a 16-byte and q 8-byte aligned.
// ---------------------------------------------------------------------------------------------
typedef struct {
  const void* a;      // [rows, k] bf16
  void* q;            // [rows, k] e4m3
  float* scales;
  int64_t rows;
  int32_t k;          // a multiple of 128
  int32_t scales_ld;  // 0: [k / 128, rows]; else [rows, scales_ld]
} megamoe_quantize_fp8_args;

typedef struct {
  const void* q;        // [rows, k] e4m3
  const float* scales;  // [k / 128, rows]
  void* a;              // [rows, k] bf16
  int64_t rows;
  int32_t k;            // a multiple of 128
} megamoe_dequantize_fp8_args;

int megamoe_quantize_rows_fp8(const megamoe_quantize_fp8_args* args, void* stream);
int megamoe_dequantize_rows_fp8(const megamoe_dequantize_fp8_args* args, void* stream);
int megamoe_quantize_blocks_fp8(const megamoe_quantize_fp8_args* args, void* stream);

// The weights' recipe with the result written transposed, for w [batches, n, k] bf16: q_t [batches,
// k, n] e4m3 and scales_t [batches, k / 128, n / 128], exactly megamoe_quantize_blocks_fp8 of w
// transposed (a 128 x 128 block transposes with its scale) while w is read once: the backward's
// K-major copy of a weight whose forward copy is not made. n and k multiples of 128; w and q_t
// 16-byte aligned.
typedef struct {
  const void* w;
  void* q_t;
  float* scales_t;
  int64_t batches;
  int32_t n;
  int32_t k;
} megamoe_quantize_blocks_transposed_fp8_args;

int megamoe_quantize_blocks_transposed_fp8(const megamoe_quantize_blocks_transposed_fp8_args* args, void* stream);

// The block-FP8 weight gradients' operands (megamoe_grouped_weight_grad_fp8): a pool
// [max_blocks * 128, cols] bf16 transposed into q_t [cols, max_blocks * 128] e4m3 and quantised along
// the pool rows (the weight gradient's K) with megamoe_quantize_rows_fp8's rounding: blocks =
// MEGAMOE_FP8_ALONG_ROWS gives one scale per column and 128 rows, scales [max_blocks, cols];
// MEGAMOE_FP8_IN_BLOCKS one per 128 x 128 block, scales [cols / 128, max_blocks]. src is that pool
// (src_rows = MEGAMOE_ROWS_POOL) or token rows [T, cols] (MEGAMOE_ROWS_TOKENS): the pool the plan's
// dispatch makes of them (pool row r = token slot_to_route[r] / K, zeros for padding rows), read
// without being made. src_dtype = MEGAMOE_SRC_E4M3: src holds e4m3 rows with src_scales
// [cols / 128, src's rows] (megamoe_quantize_rows_fp8's layout), each value dequantised to bf16 as
// megamoe_dequantize_rows_fp8 does before it is quantised again. Only the plan's live blocks
// (*num_blocks) are read and written. cols a multiple of 128; src and q_t 16-byte aligned.
#define MEGAMOE_FP8_ALONG_ROWS 0
#define MEGAMOE_FP8_IN_BLOCKS 1
#define MEGAMOE_ROWS_POOL 0
#define MEGAMOE_ROWS_TOKENS 1
#define MEGAMOE_SRC_BF16 0
#define MEGAMOE_SRC_E4M3 1

typedef struct {
  const void* src;
  void* q_t;
  float* scales;
  int32_t cols;
  int32_t blocks;             // MEGAMOE_FP8_ALONG_ROWS or MEGAMOE_FP8_IN_BLOCKS
  int32_t src_rows;           // MEGAMOE_ROWS_POOL or MEGAMOE_ROWS_TOKENS
  int32_t src_dtype;          // MEGAMOE_SRC_BF16 or MEGAMOE_SRC_E4M3
  const float* src_scales;    // MEGAMOE_SRC_E4M3 only
} megamoe_transpose_quantize_fp8_args;

int megamoe_transpose_quantize_fp8(const megamoe_routing_plan* plan, const megamoe_transpose_quantize_fp8_args* args,
                                   void* stream);

// Batched transpose of one-byte matrices: out[b, c, r] = in[b, r, c] for in [batches, rows, cols]
// (rows and cols multiples of 128, both pointers 16-byte aligned): the K-major copies of e4m3 weights.
typedef struct {
  const void* in;
  void* out;
  int64_t batches;
  int32_t rows;
  int32_t cols;
} megamoe_transpose_fp8_args;

int megamoe_transpose_fp8(const megamoe_transpose_fp8_args* args, void* stream);

// ---------------------------------------------------------------------------------------------
// Gated activations of the expert MLP: h = act(g) ⊙ u for the gate g and up u halves of x·w13ᵀ.
// ---------------------------------------------------------------------------------------------
#define MEGAMOE_ACTIVATION_SWIGLU 0  // act = silu(g) = g / (1 + exp(-g))
#define MEGAMOE_ACTIVATION_GEGLU 1   // act = gelu(g), tanh form: g / 2 (1 + tanh(√(2/π) (g + 0.044715 g³)))
// SwiGLU clamped at L = activation_limit (> 0, finite): h = silu(min(g, L)) ⊙ clamp(u, -L, L), with
// no gradient at or past a bound (DeepSeek-V4's swiglu_limit). The other activations ignore the limit.
#define MEGAMOE_ACTIVATION_SWIGLU_LIMIT 2

// ---------------------------------------------------------------------------------------------
// GEMM1 of the expert MLP with the gated activation fused into the epilogue.
// For every block b < *num_blocks with local expert e = block_expert[b] and its 128 rows:
//   g = A · w13[e][0 : I]ᵀ,  u = A · w13[e][I : 2I]ᵀ   (fp32 accumulation)
//   H = act(g) ⊙ u in fp32, rounded once to bf16
// A [max_blocks * 128, hidden] bf16; w13 [E_local, 2 * intermediate, hidden] bf16 (rows [0, I) =
// gate, [I, 2I) = up: the gate_up_proj layout); H [max_blocks * 128, intermediate] bf16.
// z: null, or [T * K, 2 * intermediate] bf16 that also receives g | u rounded to bf16 (the backward's
// z), compact: the pool's real rows without its padding, pool row expert_offsets[e] + j at row
// compact_offsets[e] + j. intermediate and hidden multiples of 8 (of 128 in the FP8 version below).
// gather_a = 1: a is the token rows x [T, hidden] bf16 instead of a pool, and GEMM1 reads pool row r
// from token row slot_to_route[r] / top_k (zeros for padding rows) itself, so no dispatch is needed:
// the same h and z bit for bit. It pays where experts get few rows (x stays in L2 while the weights
// stream; a pool would be K-fold larger and half padding).
// ---------------------------------------------------------------------------------------------
typedef struct {
  const void* a;
  const void* w13;
  void* h;
  void* z;  // may be null
  int32_t intermediate;
  int32_t hidden;
  int32_t activation;  // MEGAMOE_ACTIVATION_*
  float activation_limit;  // MEGAMOE_ACTIVATION_SWIGLU_LIMIT's L
  int32_t gather_a;    // 0: a is the pool; 1: a is the token rows (above)
} megamoe_gated_gemm_args;

int megamoe_grouped_gemm_gated_bf16(const megamoe_routing_plan* plan, const megamoe_gated_gemm_args* args,
                                    void* stream);

// The same in block FP8, with h quantised in the epilogue: A [max_blocks * 128, hidden] e4m3 with
// a_scales [hidden / 128, max_blocks * 128]; w13 [E_local, 2I, hidden] e4m3 with w13_scales
// [E_local, 2I / 128, hidden / 128] (megamoe_grouped_gemm_fp8's recipe). h = act(g) ⊙ u in fp32 is
// stored as e4m3 h [max_blocks * 128, I] with one scale per row and 128 columns, h_scales
// [I / 128, max_blocks * 128] fp32 (= amax / 448 of the 128 values, 1 for an all-zero block; the
// layout GEMM2 reads as its A scales); z, if given, as in the bf16 version.
typedef struct {
  const void* a;
  const float* a_scales;
  const void* w13;
  const float* w13_scales;
  void* h;
  float* h_scales;
  void* z;  // may be null
  int32_t intermediate;
  int32_t hidden;
  int32_t activation;  // MEGAMOE_ACTIVATION_*
  float activation_limit;  // MEGAMOE_ACTIVATION_SWIGLU_LIMIT's L
} megamoe_gated_gemm_fp8_args;

int megamoe_grouped_gemm_gated_fp8(const megamoe_routing_plan* plan, const megamoe_gated_gemm_fp8_args* args,
                                   void* stream);

// ---------------------------------------------------------------------------------------------
// A grouped GEMM whose rows are scattered: for every block b < *num_blocks with local expert
// e = block_expert[b], each pool row r of it:
//   out_rows[row_of_slot[r], :] = A[r, :] · B[e]       (fp32 accumulation, one bf16 rounding)
// with B[e] = b[e]ᵀ for b [E_local, N, K] (MEGAMOE_B_N_BY_K: GEMM2, b = w2, K = intermediate) or
// B[e] = b[e] for b [E_local, K, N] (MEGAMOE_B_K_BY_N: the backward's dx per route, b = w13,
// K = 2I, N = H). A [max_blocks * 128, K] bf16; out_rows [num_out_rows, N] bf16 (row t * top_k + k).
// row_of_slot: null for the plan's slot_to_route, or any [max_blocks * 128] map. Rows mapped to -1
// (padding) or >= num_out_rows are not written; nor is any row no pool row maps to (masked or
// non-local routes keep their contents). N and K must be multiples of 8 (of 128 in the FP8 version).
// ---------------------------------------------------------------------------------------------
#define MEGAMOE_B_N_BY_K 0
#define MEGAMOE_B_K_BY_N 1

typedef struct {
  const void* a;
  const void* b;
  void* out_rows;
  const int32_t* row_of_slot;  // may be null: the plan's slot_to_route
  int64_t num_out_rows;
  int32_t n;
  int32_t k;
  int32_t b_layout;  // MEGAMOE_B_N_BY_K or MEGAMOE_B_K_BY_N
} megamoe_scatter_gemm_args;

int megamoe_grouped_gemm_scatter_bf16(const megamoe_routing_plan* plan, const megamoe_scatter_gemm_args* args,
                                      void* stream);

// The same in block FP8, B stored [E_local, N, K] (FP8 tensor cores read both operands K-major: the
// backward's dx reads a transposed copy of w13): A [max_blocks * 128, K] e4m3 with a_scales
// [K / 128, max_blocks * 128]; b [E_local, N, K] e4m3 with b_scales [E_local, N / 128, K / 128].
typedef struct {
  const void* a;
  const float* a_scales;
  const void* b;
  const float* b_scales;
  void* out_rows;
  const int32_t* row_of_slot;  // may be null: the plan's slot_to_route
  int64_t num_out_rows;
  int32_t n;
  int32_t k;
} megamoe_scatter_gemm_fp8_args;

int megamoe_grouped_gemm_scatter_fp8(const megamoe_routing_plan* plan, const megamoe_scatter_gemm_fp8_args* args,
                                     void* stream);

// ---------------------------------------------------------------------------------------------
// Backward of the expert MLP, step 1: dh = dy_pool · w2[e] with the gated activation's backward in
// the epilogue. For every block b < *num_blocks with local expert e = block_expert[b], each of its
// 128 rows r, p = p_pool[r] (the route's top-k weight, 0 for padding rows) and i in [0, I):
//   dh = dy_pool[r] · w2[e]                  (w2 [E_local, H, I] as stored: a K = H x N = I matrix)
//   g, u = z[c, i], z[c, I + i]              (the forward's gate | up pre-activations, bf16, at the
//                                             compact row c = r - expert_offsets[e] + compact_offsets[e])
//   h = act(g) u;  dh_w = p dh;  dg = dh_w u act'(g);  du = dh_w act(g)
//   dz[r, i] = dg, dz[r, I + i] = du, hp[r, i] = p h      (bf16, fp32 math, one rounding each)
//   dp_partial[r, t] = Σ h dh over i in [128 t, 128 t + 128)   (fp32; t < MEGAMOE_DP_PARTIAL_COLS(I))
// Rows with p == 0 get dz = hp = 0 exactly. dp[route] = Σ_t dp_partial[slot, t]: megamoe_dp_reduce.
// dy_pool [max_blocks * 128, hidden], dz [max_blocks * 128, 2 * intermediate], hp [max_blocks * 128,
// intermediate] bf16; z [T * K, 2 * intermediate] bf16, compact as GEMM1 writes it; p_pool
// [max_blocks * 128] and dp_partial [max_blocks * 128, MEGAMOE_DP_PARTIAL_COLS(intermediate)] fp32.
// All 16-byte aligned; intermediate and hidden multiples of 8 (of 128 in the FP8 version). Rows of
// blocks >= *num_blocks are not touched. gather_a = 1: dy_pool is the token rows dy [T, hidden]
// instead of a pool, read by route as megamoe_gated_gemm_args' gather_a reads x: the same bits.
// ---------------------------------------------------------------------------------------------
#define MEGAMOE_DP_PARTIAL_COLS(intermediate) (((intermediate) + 127) / 128)

typedef struct {
  const void* dy_pool;
  const void* w2;
  const void* z;  // [T * K, 2 * intermediate], compact
  const float* p_pool;
  void* dz;
  void* hp;
  float* dp_partial;
  int32_t intermediate;
  int32_t hidden;
  int32_t activation;  // MEGAMOE_ACTIVATION_*, as in the forward
  float activation_limit;  // as in the forward
  int32_t gather_a;    // 0: dy_pool is the pool; 1: the token rows (above)
} megamoe_gated_backward_args;

int megamoe_grouped_gemm_gated_backward_bf16(const megamoe_routing_plan* plan,
                                             const megamoe_gated_backward_args* args, void* stream);

// The same with dh in block FP8: dy_pool [max_blocks * 128, hidden] e4m3 with dy_scales
// [hidden / 128, max_blocks * 128]; w2t [E_local, intermediate, hidden] e4m3, w2 transposed (FP8 tensor
// cores read both operands K-major), with w2t_scales [E_local, intermediate / 128, hidden / 128]. The
// epilogue and every other argument as in the bf16 version, but dz is in block FP8: dz_q
// [max_blocks * 128, 2 * intermediate] e4m3 with dz_scales [2 * intermediate / 128, max_blocks * 128],
// the bytes megamoe_quantize_rows_fp8 makes of the bf16 dz (for dx), and dz_t [2 * intermediate,
// max_blocks * 128] e4m3 with dz_t_scales [max_blocks, 2 * intermediate], the bytes
// megamoe_transpose_quantize_fp8 makes of it along the rows (MEGAMOE_FP8_ALONG_ROWS, for dW13); and hp
// as hp_t [intermediate, max_blocks * 128] e4m3 with hp_t_scales [intermediate / 128, max_blocks], what
// that function makes of it in 128 x 128 blocks (MEGAMOE_FP8_IN_BLOCKS, for dW2). The bf16 dz and hp are
// stored as well only where dz and hp are not null.
typedef struct {
  const void* dy_pool;
  const float* dy_scales;
  const void* w2t;
  const float* w2t_scales;
  const void* z;  // [T * K, 2 * intermediate], compact
  const float* p_pool;
  void* dz;  // optional
  void* hp;  // optional
  float* dp_partial;
  void* dz_q;
  float* dz_scales;
  void* dz_t;
  float* dz_t_scales;
  void* hp_t;
  float* hp_t_scales;
  int32_t intermediate;
  int32_t hidden;
  int32_t activation;  // MEGAMOE_ACTIVATION_*, as in the forward
  float activation_limit;  // as in the forward
} megamoe_gated_backward_fp8_args;

int megamoe_grouped_gemm_gated_backward_fp8(const megamoe_routing_plan* plan,
                                            const megamoe_gated_backward_fp8_args* args, void* stream);

// dp[route] = Σ_t dp_partial[route_to_slot[route], t] for the plan's T * K routes, t ascending over
// MEGAMOE_DP_PARTIAL_COLS(intermediate) columns, fp32 (deterministic). Routes with slot -1 or a slot
// outside the pool get 0. dp [T * K] fp32 (the d(topk_weights) of the layer).
typedef struct {
  const float* dp_partial;
  float* dp;
  int32_t intermediate;
} megamoe_dp_reduce_args;

int megamoe_dp_reduce(const megamoe_routing_plan* plan, const megamoe_dp_reduce_args* args, void* stream);

// ---------------------------------------------------------------------------------------------
// Weight gradients, K-grouped over each expert's routed pool rows: from expert_offsets[e],
// expert_counts[e] rows rounded up to a multiple of 64 (never past expert_offsets[e + 1]):
//   out[e] (+)= a_pool[rows of e]ᵀ · b_pool[rows of e]          out[e]: [m, n], fp32 accumulation
// a_pool [max_blocks * 128, m], b_pool [max_blocks * 128, n] bf16 (token-major, as the pool holds
// them); out [E_local, m, n] in the format `output` names. dw2 = (a = dy_pool, b = hp = p·h; m = H,
// n = I) has w2's layout, dw13 = (a = dz, b = x_pool; m = 2I, n = H) has w13's. Padding rows inside
// the last 64-row k-block must be zero in a or b and finite in both (dispatch and the dh epilogue
// write zeros there); the padding past it is never read. An expert with no rows gets zeros
// (MEGAMOE_GRAD_FP32_ADD: out unchanged). m and n multiples of 8; 16-byte aligned. out_ld: elements
// between rows of out, 0 for n; a larger one (a multiple of 8) writes columns [c, c + n) of a wider
// gradient [E_local, m, out_ld] whose column c out points at, e.g. dw13 in column slices of H, each
// from a pool of x's same columns (a pool of x a slice wide, not H). gather_b = 1: b_pool is the
// token rows x [T, n] instead of a pool, each pool row read from token row slot_to_route[r] / top_k
// (zeros for padding rows): dw13 with no pool of x, the same bits (small batches, where x stays in
// L2). gather_a = 1: a_pool is the token rows dy [T, m], read the same way (dw2 with no pool of dy);
// at most one of the two.
// ---------------------------------------------------------------------------------------------
#define MEGAMOE_GRAD_BF16 0      // out is bf16, overwritten
#define MEGAMOE_GRAD_FP32 1      // out is fp32, overwritten
#define MEGAMOE_GRAD_FP32_ADD 2  // out is fp32, out += gradient (a main_grad)

typedef struct {
  const void* a_pool;
  const void* b_pool;
  void* out;
  int32_t m;
  int32_t n;
  int32_t output;  // MEGAMOE_GRAD_*
  int32_t out_ld;  // 0: n
  int32_t gather_b;  // 0: b_pool is the pool; 1: the token rows (above)
  int32_t gather_a;  // 0: a_pool is the pool; 1: the token rows (above)
} megamoe_weight_grad_args;

int megamoe_grouped_weight_grad_bf16(const megamoe_routing_plan* plan, const megamoe_weight_grad_args* args,
                                     void* stream);

// The same in block FP8, on the operands given transposed (FP8 tensor cores read both K-major):
// a_t [m, max_blocks * 128] e4m3 = a_poolᵀ with a_scales [max_blocks * 128 / 128, m] fp32 (one per
// row of a_t and 128 pool rows: 1 x 128 blocks along the tokens), b_t [n, max_blocks * 128] e4m3 =
// b_poolᵀ with b_scales [n / 128, max_blocks * 128 / 128] fp32 (one per 128 x 128 block). K runs over
// each expert's routed rows rounded up to 128: their padding rows must be zero in a_t or b_t. fp32
// accumulation of each 128-deep k-block's products, scaled and added in order; out as in the bf16
// version. m and n multiples of 128; 16-byte aligned.
typedef struct {
  const void* a_t;
  const float* a_scales;
  const void* b_t;
  const float* b_scales;
  void* out;
  int32_t m;
  int32_t n;
  int32_t output;  // MEGAMOE_GRAD_*
} megamoe_weight_grad_fp8_args;

int megamoe_grouped_weight_grad_fp8(const megamoe_routing_plan* plan, const megamoe_weight_grad_fp8_args* args,
                                    void* stream);

#ifdef __cplusplus
}
#endif
