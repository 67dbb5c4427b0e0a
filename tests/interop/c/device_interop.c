/*
 * A C consumer and producer of devarrow's device data, the way a C library (libcudf and
 * the like) uses the Arrow C device interfaces: only include/arrow_c_device.h, the
 * devarrow-interop functions declared below, and the CUDA driver API loaded with dlopen
 * (its few types and prototypes declared here), so it builds without a CUDA toolkit.
 * Built and run by tests/c_program.rs:
 *
 *   device_interop cpu     on devarrow's CPU device (malloc'd buffers, no events)
 *   device_interop cuda    on CUDA device 0 (the driver found by dlopen: a GPU's, or the
 *                          emulated one of .ci/emulated-gpu)
 *
 * The data: the "C batches" of tests/interop/src/device_capi.rs, whose values this
 * program computes itself (see expected_*): 20 rows of a nullable int32 column "i" and a
 * nullable utf8 column "s"; batch 0 all rows, 1 and 2 rows 3..14 (exported by C with the
 * offset on the columns (1) or on the root struct (2)).
 *
 * What it checks, in order:
 *  1. devarrow -> C, ArrowDeviceArray: devarrow uploads and exports batches 0 and 1; C
 *     makes its own stream wait on *sync_event (cuStreamWaitEvent), copies every buffer
 *     to the host on that stream (direct reads on the CPU), checks layout, null counts
 *     and values, and releases array and schema on another thread (pthread).
 *  2. devarrow -> C, ArrowDeviceArrayStream: the same for each array of a stream of
 *     batches 0, 1, 0; the stream is released on another thread while the first array is
 *     still held, which is released afterwards.
 *  3. C -> devarrow, ArrowDeviceArray: C allocates (cuMemAlloc / malloc), fills it
 *     (cuMemcpyHtoDAsync on its stream), records an event and exports batches 0, 1, 2
 *     with release callbacks that count their calls; devarrow imports each on the device
 *     (DeviceBatch::import_raw), downloads it and compares. Then two arrays devarrow must
 *     refuse: one naming another device type, one whose schema has a child too many.
 *     Every array and schema is released exactly once.
 *  4. C async producer -> devarrow's async consumer: read to the end (4 batches), then a
 *     long stream cancelled midway (devarrow reads 3 batches and drops its stream): the
 *     producer honours cancel, stops and releases the handler; every task is extracted
 *     once (devarrow discards late ones with extract_data(task, NULL)), every array
 *     released once, cancel called once, no more tasks than requested.
 *  5. devarrow's async producer -> C async consumer: read to the end, then a consumer
 *     that returns an error from on_next_task at its 4th task: devarrow must then call
 *     only release (no on_error, no further task), drop its source and release every
 *     array it exported exactly once (checked on the Rust side); C releases the arrays
 *     it extracted on another thread.
 *
 * Any failure prints FAIL and exits with 1 at once; success prints "all checks passed".
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "arrow_c_device.h"

/* ---- devarrow-interop (tests/interop/src/capi.rs, device_capi.rs) ------------------ */

struct DevarrowInteropDevice;
struct DevarrowInteropAsyncConsumer;
struct DevarrowInteropAsyncProducer;

const char* devarrow_interop_last_error(void);
int devarrow_interop_open(int cuda, struct DevarrowInteropDevice** out);
void devarrow_interop_close(struct DevarrowInteropDevice* device);
const char* devarrow_interop_device_describe(const struct DevarrowInteropDevice* device);
int devarrow_interop_device_export(const struct DevarrowInteropDevice* device, int which,
                                   struct ArrowDeviceArray* out,
                                   struct ArrowSchema* out_schema);
int devarrow_interop_device_export_stream(const struct DevarrowInteropDevice* device,
                                          struct ArrowDeviceArrayStream* out);
int devarrow_interop_device_import_check(const struct DevarrowInteropDevice* device,
                                         int which, struct ArrowDeviceArray* array,
                                         struct ArrowSchema* schema);
int devarrow_interop_device_async_consumer_new(
    const struct DevarrowInteropDevice* device, int64_t capacity,
    struct DevarrowInteropAsyncConsumer** out,
    struct ArrowAsyncDeviceStreamHandler** out_handler);
int devarrow_interop_device_async_consumer_read(
    struct DevarrowInteropAsyncConsumer* consumer, int take, int n_batches);
int devarrow_interop_device_async_produce(const struct DevarrowInteropDevice* device,
                                          int n_batches,
                                          struct ArrowAsyncDeviceStreamHandler* handler,
                                          struct DevarrowInteropAsyncProducer** out);
int devarrow_interop_device_async_produce_finish(
    struct DevarrowInteropAsyncProducer* producer, int expected_rc, int* out_arrays);

/* ---- Failing ----------------------------------------------------------------------- */

static void fail(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  fprintf(stdout, "FAIL: ");
  vfprintf(stdout, fmt, args);
  fprintf(stdout, "\n");
  va_end(args);
  fflush(stdout);
  fflush(stderr);
  /* Other threads (devarrow's, the driver's) may be running: no exit handlers. */
  _exit(1);
}

#define CHECK(cond, ...)      \
  do {                        \
    if (!(cond)) fail(__VA_ARGS__); \
  } while (0)

/* A devarrow-interop call that must succeed. */
#define DEVARROW(call)                                                              \
  do {                                                                              \
    int rc_ = (call);                                                               \
    if (rc_ != 0)                                                                   \
      fail("%s:%d: %s returned %d: %s", __FILE__, __LINE__, #call, rc_,             \
           devarrow_interop_last_error());                                          \
  } while (0)

/* ---- The CUDA driver API, loaded at run time --------------------------------------- */

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st* CUcontext;
typedef struct CUstream_st* CUstream;
typedef struct CUevent_st* CUevent;
typedef unsigned long long CUdeviceptr;

#define CUDA_SUCCESS 0
#define CU_STREAM_NON_BLOCKING 0x1
#define CU_EVENT_DISABLE_TIMING 0x2

static struct {
  void* lib;
  CUresult (*Init)(unsigned int);
  CUresult (*DeviceGet)(CUdevice*, int);
  CUresult (*DeviceGetName)(char*, int, CUdevice);
  CUresult (*DevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*DevicePrimaryCtxRelease)(CUdevice);
  CUresult (*CtxSetCurrent)(CUcontext);
  CUresult (*CtxPushCurrent)(CUcontext);
  CUresult (*CtxPopCurrent)(CUcontext*);
  CUresult (*StreamCreate)(CUstream*, unsigned int);
  CUresult (*StreamDestroy)(CUstream);
  CUresult (*StreamWaitEvent)(CUstream, CUevent, unsigned int);
  CUresult (*StreamSynchronize)(CUstream);
  CUresult (*MemAlloc)(CUdeviceptr*, size_t);
  CUresult (*MemFree)(CUdeviceptr);
  CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream);
  CUresult (*MemcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream);
  CUresult (*EventCreate)(CUevent*, unsigned int);
  CUresult (*EventRecord)(CUevent, CUstream);
  CUresult (*EventDestroy)(CUevent);
  CUresult (*GetErrorName)(CUresult, const char**);
  CUdevice device;
  CUcontext context;
} cu;

static int g_cuda; /* 1: CUDA device 0; 0: the CPU device */
/* This program's own stream (CUDA): every copy of its own is enqueued on it. */
static CUstream g_stream;

static void cu_check(CUresult rc, const char* call, const char* file, int line) {
  if (rc != CUDA_SUCCESS) {
    const char* name = "?";
    if (cu.GetErrorName) cu.GetErrorName(rc, &name);
    fail("%s:%d: %s returned %d (%s)", file, line, call, rc, name);
  }
}
#define CU(call) cu_check(cu.call, #call, __FILE__, __LINE__)

static void cu_load(void) {
  const char* names[] = {"libcuda.so.1", "libcuda.so"};
  for (size_t i = 0; i < 2 && !cu.lib; i++) cu.lib = dlopen(names[i], RTLD_NOW);
  CHECK(cu.lib, "cannot dlopen libcuda.so.1 or libcuda.so: %s", dlerror());
#define LOAD(field, symbol)                                                   \
  do {                                                                        \
    *(void**)(&cu.field) = dlsym(cu.lib, symbol);                             \
    CHECK(cu.field, "libcuda has no %s", symbol);                             \
  } while (0)
  LOAD(Init, "cuInit");
  LOAD(DeviceGet, "cuDeviceGet");
  LOAD(DeviceGetName, "cuDeviceGetName");
  LOAD(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  LOAD(DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
  LOAD(CtxSetCurrent, "cuCtxSetCurrent");
  LOAD(CtxPushCurrent, "cuCtxPushCurrent_v2");
  LOAD(CtxPopCurrent, "cuCtxPopCurrent_v2");
  LOAD(StreamCreate, "cuStreamCreate");
  LOAD(StreamDestroy, "cuStreamDestroy_v2");
  LOAD(StreamWaitEvent, "cuStreamWaitEvent");
  LOAD(StreamSynchronize, "cuStreamSynchronize");
  LOAD(MemAlloc, "cuMemAlloc_v2");
  LOAD(MemFree, "cuMemFree_v2");
  LOAD(MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
  LOAD(MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
  LOAD(EventCreate, "cuEventCreate");
  LOAD(EventRecord, "cuEventRecord");
  LOAD(EventDestroy, "cuEventDestroy_v2");
  LOAD(GetErrorName, "cuGetErrorName");
#undef LOAD
  CU(Init(0));
  CU(DeviceGet(&cu.device, 0));
  CU(DevicePrimaryCtxRetain(&cu.context, cu.device));
  CU(CtxSetCurrent(cu.context));
  CU(StreamCreate(&g_stream, CU_STREAM_NON_BLOCKING));
  char name[256] = {0};
  CU(DeviceGetName(name, (int)sizeof name - 1, cu.device));
  printf("cuda: libcuda loaded with dlopen, device 0 is \"%s\"\n", name);
}

/* Code that may run on any thread (devarrow's callbacks, release threads) binds the
 * context around its driver calls, as a library must. */
static void ctx_enter(void) {
  if (g_cuda) CU(CtxPushCurrent(cu.context));
}
static void ctx_leave(void) {
  if (g_cuda) {
    CUcontext popped;
    CU(CtxPopCurrent(&popped));
  }
}

/* ---- Time -------------------------------------------------------------------------- */

static struct timespec deadline_in(int seconds) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_sec += seconds;
  return ts;
}

static int past(struct timespec deadline) {
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  return now.tv_sec > deadline.tv_sec ||
         (now.tv_sec == deadline.tv_sec && now.tv_nsec >= deadline.tv_nsec);
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* ---- The expected data ------------------------------------------------------------- */

#define ROWS 20
#define SLICE_OFFSET 3
#define SLICE_LENGTH 11

static int expected_i_valid(int r) { return r % 3 != 1; }
static int32_t expected_i(int r) { return 7 * r - 50; }
static int expected_s_valid(int r) { return r % 4 != 2; }
static int expected_s_len(int r) { return r % 5 == 0 ? 0 : r % 7 + 1; }
static char expected_s_char(int r, int k) { return (char)('a' + (r + k) % 26); }

/* The rows of the whole batch that batch `which` holds. */
static void expected_rows(int which, int* first, int* count) {
  *first = which == 0 ? 0 : SLICE_OFFSET;
  *count = which == 0 ? ROWS : SLICE_LENGTH;
}

/* ---- Reading a device array (the consumer side) ------------------------------------ */

/* Copies `n` bytes of device (or CPU) memory at `src` to the host, on g_stream. */
static void* fetch(const void* src, size_t n) {
  void* dst = malloc(n ? n : 1);
  CHECK(dst, "out of memory");
  if (n == 0) return dst;
  CHECK(src, "a NULL buffer of %zu bytes", n);
  if (g_cuda) {
    CU(MemcpyDtoHAsync(dst, (CUdeviceptr)(uintptr_t)src, n, g_stream));
    CU(StreamSynchronize(g_stream));
  } else {
    memcpy(dst, src, n);
  }
  return dst;
}

static int bit(const uint8_t* bitmap, int64_t i) {
  return bitmap == NULL || ((bitmap[i / 8] >> (i % 8)) & 1);
}

static int64_t count_nulls(const uint8_t* bitmap, int64_t from, int64_t n) {
  int64_t nulls = 0;
  for (int64_t i = from; i < from + n; i++) nulls += !bit(bitmap, i);
  return nulls;
}

static void check_schema(const struct ArrowSchema* schema, const char* what) {
  CHECK(schema->release, "%s: the schema is released", what);
  CHECK(strcmp(schema->format, "+s") == 0, "%s: root format %s", what, schema->format);
  CHECK(schema->n_children == 2, "%s: %lld children", what,
        (long long)schema->n_children);
  const char* names[2] = {"i", "s"};
  const char* formats[2] = {"i", "u"};
  for (int c = 0; c < 2; c++) {
    const struct ArrowSchema* child = schema->children[c];
    CHECK(child->name && strcmp(child->name, names[c]) == 0, "%s: child %d named %s",
          what, c, child->name ? child->name : "(null)");
    CHECK(strcmp(child->format, formats[c]) == 0, "%s: child %s of format %s", what,
          names[c], child->format);
    CHECK(child->flags & ARROW_FLAG_NULLABLE, "%s: child %s not nullable", what,
          names[c]);
  }
}

/* Checks an array devarrow exported: its device, layout and every value of batch `which`.
 * On CUDA, g_stream first waits on the array's sync_event (a CUevent*). */
static void check_array(const struct ArrowDeviceArray* device_array, int which,
                        const char* what) {
  int first, rows;
  expected_rows(which, &first, &rows);
  const struct ArrowArray* root = &device_array->array;
  CHECK(root->release, "%s: the array is released", what);
  if (g_cuda) {
    CHECK(device_array->device_type == ARROW_DEVICE_CUDA, "%s: device type %d", what,
          (int)device_array->device_type);
    CHECK(device_array->device_id == 0, "%s: device id %lld", what,
          (long long)device_array->device_id);
    CHECK(device_array->sync_event, "%s: no sync_event", what);
    CU(StreamWaitEvent(g_stream, *(CUevent*)device_array->sync_event, 0));
  } else {
    CHECK(device_array->device_type == ARROW_DEVICE_CPU, "%s: device type %d", what,
          (int)device_array->device_type);
    CHECK(device_array->sync_event == NULL, "%s: a sync_event on the CPU", what);
  }
  CHECK(root->length == rows, "%s: %lld rows, expected %d", what, (long long)root->length,
        rows);
  CHECK(root->n_buffers == 1 && root->n_children == 2, "%s: root with %lld buffers, %lld "
        "children", what, (long long)root->n_buffers, (long long)root->n_children);
  CHECK(root->buffers[0] == NULL || root->null_count == 0,
        "%s: a root validity bitmap (%lld nulls)", what, (long long)root->null_count);
  const int64_t ro = root->offset;

  /* i: int32 */
  const struct ArrowArray* ci = root->children[0];
  CHECK(ci->n_buffers == 2, "%s: i has %lld buffers", what, (long long)ci->n_buffers);
  CHECK(ci->length >= ro + rows, "%s: i has %lld rows, the root uses %lld", what,
        (long long)ci->length, (long long)(ro + rows));
  int64_t end = ci->offset + ci->length;
  uint8_t* iv = ci->buffers[0] ? fetch(ci->buffers[0], (size_t)(end + 7) / 8) : NULL;
  CHECK(iv || ci->null_count == 0, "%s: i has %lld nulls and no bitmap", what,
        (long long)ci->null_count);
  int32_t* values = fetch(ci->buffers[1], (size_t)end * 4);
  if (ci->null_count >= 0) {
    int64_t nulls = count_nulls(iv, ci->offset, ci->length);
    CHECK(ci->null_count == nulls, "%s: i says %lld nulls, its bitmap %lld", what,
          (long long)ci->null_count, (long long)nulls);
  }

  /* s: utf8 */
  const struct ArrowArray* cs = root->children[1];
  CHECK(cs->n_buffers == 3, "%s: s has %lld buffers", what, (long long)cs->n_buffers);
  CHECK(cs->length >= ro + rows, "%s: s has %lld rows, the root uses %lld", what,
        (long long)cs->length, (long long)(ro + rows));
  end = cs->offset + cs->length;
  uint8_t* sv = cs->buffers[0] ? fetch(cs->buffers[0], (size_t)(end + 7) / 8) : NULL;
  CHECK(sv || cs->null_count == 0, "%s: s has %lld nulls and no bitmap", what,
        (long long)cs->null_count);
  int32_t* offsets = fetch(cs->buffers[1], (size_t)(end + 1) * 4);
  CHECK(offsets[end] >= 0, "%s: s ends at offset %d", what, offsets[end]);
  char* data = fetch(cs->buffers[2], (size_t)offsets[end]);
  if (cs->null_count >= 0) {
    int64_t nulls = count_nulls(sv, cs->offset, cs->length);
    CHECK(cs->null_count == nulls, "%s: s says %lld nulls, its bitmap %lld", what,
          (long long)cs->null_count, (long long)nulls);
  }

  for (int k = 0; k < rows; k++) {
    int r = first + k;
    int64_t at = ci->offset + ro + k;
    CHECK(bit(iv, at) == expected_i_valid(r), "%s: row %d of i: valid %d, expected %d",
          what, k, bit(iv, at), expected_i_valid(r));
    if (expected_i_valid(r))
      CHECK(values[at] == expected_i(r), "%s: row %d of i: %d, expected %d", what, k,
            values[at], expected_i(r));
    at = cs->offset + ro + k;
    CHECK(bit(sv, at) == expected_s_valid(r), "%s: row %d of s: valid %d, expected %d",
          what, k, bit(sv, at), expected_s_valid(r));
    if (expected_s_valid(r)) {
      int len = offsets[at + 1] - offsets[at];
      CHECK(offsets[at] >= 0 && len == expected_s_len(r),
            "%s: row %d of s: %d bytes at %d, expected %d", what, k, len, offsets[at],
            expected_s_len(r));
      for (int c = 0; c < len; c++)
        CHECK(data[offsets[at] + c] == expected_s_char(r, c),
              "%s: row %d of s: byte %d is %d, expected %c", what, k, c,
              data[offsets[at] + c], expected_s_char(r, c));
    }
  }
  free(iv);
  free(values);
  free(sv);
  free(offsets);
  free(data);
}

/* Releases on a thread of its own (never the exporter's). */
static void* release_array_main(void* p) {
  struct ArrowDeviceArray* array = p;
  array->array.release(&array->array);
  return NULL;
}
static void* release_schema_main(void* p) {
  struct ArrowSchema* schema = p;
  schema->release(schema);
  return NULL;
}
static void* release_stream_main(void* p) {
  struct ArrowDeviceArrayStream* stream = p;
  stream->release(stream);
  return NULL;
}

static void on_another_thread(void* (*main)(void*), void* arg) {
  pthread_t thread;
  CHECK(pthread_create(&thread, NULL, main, arg) == 0, "pthread_create");
  CHECK(pthread_join(thread, NULL) == 0, "pthread_join");
}

static void release_array_elsewhere(struct ArrowDeviceArray* array, const char* what) {
  on_another_thread(release_array_main, array);
  CHECK(array->array.release == NULL, "%s: release did not mark the array released",
        what);
}

static void release_schema_elsewhere(struct ArrowSchema* schema, const char* what) {
  on_another_thread(release_schema_main, schema);
  CHECK(schema->release == NULL, "%s: release did not mark the schema released", what);
}

/* ---- 1. and 2.: devarrow -> C ------------------------------------------------------ */

static void consume_devarrow_arrays(struct DevarrowInteropDevice* device) {
  for (int which = 0; which < 2; which++) {
    char what[64];
    snprintf(what, sizeof what, "devarrow's array %d", which);
    struct ArrowDeviceArray array;
    struct ArrowSchema schema;
    DEVARROW(devarrow_interop_device_export(device, which, &array, &schema));
    check_schema(&schema, what);
    check_array(&array, which, what);
    release_array_elsewhere(&array, what);
    release_schema_elsewhere(&schema, what);
    printf("1. %s: checked (%lld rows, root offset %lld), released on another thread\n",
           what, (long long)array.array.length, (long long)array.array.offset);
  }
}

static void consume_devarrow_stream(struct DevarrowInteropDevice* device) {
  struct ArrowDeviceArrayStream stream;
  DEVARROW(devarrow_interop_device_export_stream(device, &stream));
  CHECK(stream.device_type == (g_cuda ? ARROW_DEVICE_CUDA : ARROW_DEVICE_CPU),
        "the stream's device type %d", (int)stream.device_type);
  struct ArrowSchema schema;
  int rc = stream.get_schema(&stream, &schema);
  CHECK(rc == 0, "get_schema: %d (%s)", rc, stream.get_last_error(&stream));
  check_schema(&schema, "devarrow's stream");
  release_schema_elsewhere(&schema, "devarrow's stream");

  const int expected[3] = {0, 1, 0};
  struct ArrowDeviceArray held; /* the first array, released after the stream */
  int n = 0;
  for (;;) {
    struct ArrowDeviceArray array;
    rc = stream.get_next(&stream, &array);
    CHECK(rc == 0, "get_next: %d (%s)", rc, stream.get_last_error(&stream));
    if (array.array.release == NULL) break;
    CHECK(n < 3, "devarrow's stream has more than 3 arrays");
    char what[64];
    snprintf(what, sizeof what, "array %d of devarrow's stream", n);
    check_array(&array, expected[n], what);
    if (n == 0)
      held = array;
    else
      release_array_elsewhere(&array, what);
    n++;
  }
  CHECK(n == 3, "devarrow's stream has %d arrays, expected 3", n);
  on_another_thread(release_stream_main, &stream);
  CHECK(stream.release == NULL, "release did not mark the stream released");
  /* The stream is gone, its first array still valid. */
  check_array(&held, 0, "array 0 of devarrow's stream, after the stream's release");
  release_array_elsewhere(&held, "array 0 of devarrow's stream");
  printf("2. devarrow's device stream: 3 arrays checked; the stream and every array "
         "released on another thread, the first after the stream\n");
}

/* ---- Exporting C's own arrays (the producer side) ---------------------------------- */

#define MAX_EXPORTS 1024

static pthread_mutex_t g_export_mutex = PTHREAD_MUTEX_INITIALIZER;
static int g_exports;                    /* arrays exported */
static int g_array_releases[MAX_EXPORTS]; /* release calls, per array */
static int g_released_arrays;            /* arrays released at least once */
static int g_schema_exports, g_schema_releases;

struct c_array {
  int index; /* into g_array_releases */
  void* memory; /* device memory (cuMemAlloc) or malloc'd */
  uint8_t* image; /* the host image the memory was filled from */
  CUevent event;  /* recorded after the fill (CUDA) */
  const void* root_buffers[1];
  const void* i_buffers[2];
  const void* s_buffers[3];
  struct ArrowArray children[2];
  struct ArrowArray* child_ptrs[2];
};

static void c_child_release(struct ArrowArray* array) { array->release = NULL; }

static void c_array_release(struct ArrowArray* array) {
  CHECK(array->release == c_array_release, "C array: release called on a released array");
  struct c_array* priv = array->private_data;
  for (int c = 0; c < 2; c++)
    if (priv->children[c].release) priv->children[c].release(&priv->children[c]);
  if (g_cuda) {
    ctx_enter();
    /* The fill was enqueued on g_stream: let it finish before freeing its source. */
    CU(StreamSynchronize(g_stream));
    CU(MemFree((CUdeviceptr)(uintptr_t)priv->memory));
    CU(EventDestroy(priv->event));
    ctx_leave();
  } else {
    free(priv->memory);
  }
  free(priv->image);
  pthread_mutex_lock(&g_export_mutex);
  if (g_array_releases[priv->index]++ == 0) g_released_arrays++;
  pthread_mutex_unlock(&g_export_mutex);
  free(priv);
  array->release = NULL;
  array->private_data = NULL;
}

static size_t align64(size_t n) { return (n + 63) / 64 * 64; }

/* Exports batch `which` (0, 1: offsets on the columns, 2: the offset on the root) as an
 * ArrowDeviceArray of the device: one allocation holding every buffer of all 20 rows. */
static void c_export_array(int which, struct ArrowDeviceArray* out) {
  struct c_array* priv = calloc(1, sizeof *priv);
  CHECK(priv, "out of memory");
  /* Layout: i validity, i values, s validity, s offsets, s data. */
  size_t at_iv = 0, at_i = align64(at_iv + (ROWS + 7) / 8);
  size_t at_sv = align64(at_i + ROWS * 4), at_so = align64(at_sv + (ROWS + 7) / 8);
  size_t at_sd = align64(at_so + (ROWS + 1) * 4);
  size_t data_len = 0;
  for (int r = 0; r < ROWS; r++) data_len += expected_s_valid(r) ? expected_s_len(r) : 0;
  size_t size = align64(at_sd + data_len);
  uint8_t* image = calloc(1, size);
  CHECK(image, "out of memory");
  int32_t* ivals = (int32_t*)(image + at_i);
  int32_t* soffs = (int32_t*)(image + at_so);
  char* sdata = (char*)(image + at_sd);
  int64_t i_nulls = 0, s_nulls = 0;
  soffs[0] = 0;
  for (int r = 0; r < ROWS; r++) {
    if (expected_i_valid(r)) {
      image[at_iv + r / 8] |= (uint8_t)(1u << (r % 8));
      ivals[r] = expected_i(r);
    } else {
      ivals[r] = -1; /* garbage under a null */
      i_nulls++;
    }
    int len = 0;
    if (expected_s_valid(r)) {
      image[at_sv + r / 8] |= (uint8_t)(1u << (r % 8));
      len = expected_s_len(r);
      for (int k = 0; k < len; k++) sdata[soffs[r] + k] = expected_s_char(r, k);
    } else {
      s_nulls++;
    }
    soffs[r + 1] = soffs[r] + len;
  }

  uint8_t* memory;
  if (g_cuda) {
    ctx_enter();
    CUdeviceptr dptr;
    CU(MemAlloc(&dptr, size));
    /* The stream kept busy before the fill (on the emulated driver every operation takes
     * DEVARROW_EMU_DELAY_US and more): a consumer that does not wait on the event reads
     * the memory unfilled (the emulator's poison bytes). */
    for (int k = 0; k < 16; k++) CU(MemcpyHtoDAsync(dptr, image, 64, g_stream));
    CU(MemcpyHtoDAsync(dptr, image, size, g_stream));
    CU(EventCreate(&priv->event, CU_EVENT_DISABLE_TIMING));
    CU(EventRecord(priv->event, g_stream));
    ctx_leave();
    memory = (uint8_t*)(uintptr_t)dptr;
  } else {
    memory = aligned_alloc(64, size);
    CHECK(memory, "out of memory");
    memcpy(memory, image, size);
  }
  priv->memory = memory;
  priv->image = image;

  int64_t root_offset = which == 2 ? SLICE_OFFSET : 0;
  int64_t root_length = which == 0 ? ROWS : SLICE_LENGTH;
  int64_t child_offset = which == 1 ? SLICE_OFFSET : 0;
  int64_t child_length = which == 1 ? SLICE_LENGTH : ROWS;
  if (which == 1) { /* the nulls of the children's own range */
    i_nulls = s_nulls = 0;
    for (int r = SLICE_OFFSET; r < SLICE_OFFSET + SLICE_LENGTH; r++) {
      i_nulls += !expected_i_valid(r);
      s_nulls += !expected_s_valid(r);
    }
  }
  priv->i_buffers[0] = memory + at_iv;
  priv->i_buffers[1] = memory + at_i;
  priv->s_buffers[0] = memory + at_sv;
  priv->s_buffers[1] = memory + at_so;
  priv->s_buffers[2] = memory + at_sd;
  priv->children[0] = (struct ArrowArray){
      .length = child_length, .null_count = i_nulls, .offset = child_offset,
      .n_buffers = 2, .buffers = priv->i_buffers, .release = c_child_release};
  priv->children[1] = (struct ArrowArray){
      .length = child_length, .null_count = which == 2 ? -1 : s_nulls,
      .offset = child_offset, .n_buffers = 3, .buffers = priv->s_buffers,
      .release = c_child_release};
  priv->child_ptrs[0] = &priv->children[0];
  priv->child_ptrs[1] = &priv->children[1];
  priv->root_buffers[0] = NULL;

  pthread_mutex_lock(&g_export_mutex);
  CHECK(g_exports < MAX_EXPORTS, "too many exports");
  priv->index = g_exports++;
  pthread_mutex_unlock(&g_export_mutex);

  memset(out, 0, sizeof *out);
  out->array = (struct ArrowArray){.length = root_length, .null_count = 0,
                                   .offset = root_offset, .n_buffers = 1,
                                   .n_children = 2, .buffers = priv->root_buffers,
                                   .children = priv->child_ptrs,
                                   .release = c_array_release, .private_data = priv};
  out->device_id = g_cuda ? 0 : -1;
  out->device_type = g_cuda ? ARROW_DEVICE_CUDA : ARROW_DEVICE_CPU;
  out->sync_event = g_cuda ? (void*)&priv->event : NULL;
}

struct c_schema {
  struct ArrowSchema children[3];
  struct ArrowSchema* child_ptrs[3];
};

static void c_child_schema_release(struct ArrowSchema* schema) { schema->release = NULL; }

static void c_schema_release(struct ArrowSchema* schema) {
  CHECK(schema->release == c_schema_release, "C schema: release of a released schema");
  struct c_schema* priv = schema->private_data;
  for (int c = 0; c < schema->n_children; c++)
    if (priv->children[c].release) priv->children[c].release(&priv->children[c]);
  free(priv);
  pthread_mutex_lock(&g_export_mutex);
  g_schema_releases++;
  pthread_mutex_unlock(&g_export_mutex);
  schema->release = NULL;
  schema->private_data = NULL;
}

/* The batches' schema; with `extra_child`, a third column "x" the arrays do not have. */
static void c_export_schema(int extra_child, struct ArrowSchema* out) {
  struct c_schema* priv = calloc(1, sizeof *priv);
  CHECK(priv, "out of memory");
  const char* names[3] = {"i", "s", "x"};
  const char* formats[3] = {"i", "u", "i"};
  int n = extra_child ? 3 : 2;
  for (int c = 0; c < n; c++) {
    priv->children[c] = (struct ArrowSchema){.format = formats[c], .name = names[c],
                                             .flags = ARROW_FLAG_NULLABLE,
                                             .release = c_child_schema_release};
    priv->child_ptrs[c] = &priv->children[c];
  }
  *out = (struct ArrowSchema){.format = "+s", .name = "", .n_children = n,
                              .children = priv->child_ptrs, .release = c_schema_release,
                              .private_data = priv};
  pthread_mutex_lock(&g_export_mutex);
  g_schema_exports++;
  pthread_mutex_unlock(&g_export_mutex);
}

static int array_releases(int index) {
  pthread_mutex_lock(&g_export_mutex);
  int n = g_array_releases[index];
  pthread_mutex_unlock(&g_export_mutex);
  return n;
}

static int released_arrays(void) {
  pthread_mutex_lock(&g_export_mutex);
  int n = g_released_arrays;
  pthread_mutex_unlock(&g_export_mutex);
  return n;
}

/* Waits (up to 30 s) for every array exported so far to be released, then checks that
 * each was released exactly once. */
static void check_all_released(const char* what) {
  struct timespec deadline = deadline_in(30);
  pthread_mutex_lock(&g_export_mutex);
  int exports = g_exports;
  pthread_mutex_unlock(&g_export_mutex);
  while (released_arrays() < exports && !past(deadline)) sleep_ms(5);
  for (int i = 0; i < exports; i++)
    CHECK(array_releases(i) == 1, "%s: C array %d was released %d times", what, i,
          array_releases(i));
  pthread_mutex_lock(&g_export_mutex);
  int schemas = g_schema_exports, schema_releases = g_schema_releases;
  pthread_mutex_unlock(&g_export_mutex);
  CHECK(schemas == schema_releases, "%s: %d schemas exported, %d releases", what, schemas,
        schema_releases);
}

/* ---- 3. C -> devarrow -------------------------------------------------------------- */

static void produce_arrays_for_devarrow(struct DevarrowInteropDevice* device) {
  for (int which = 0; which < 3; which++) {
    struct ArrowDeviceArray array;
    struct ArrowSchema schema;
    c_export_array(which, &array);
    c_export_schema(0, &schema);
    int index = g_exports - 1;
    DEVARROW(devarrow_interop_device_import_check(device, which, &array, &schema));
    CHECK(array.array.release == NULL && schema.release == NULL,
          "C array %d: devarrow did not move the structs", which);
    check_all_released("C arrays read by devarrow");
    printf("3. C's array %d (%s): imported and downloaded by devarrow, values equal; "
           "array and schema released once (array release count %d)\n",
           which, which == 0 ? "whole" : which == 1 ? "column offsets" : "root offset",
           array_releases(index));
  }

  /* Arrays devarrow must refuse, releasing them all the same. */
  for (int bad = 0; bad < 2; bad++) {
    struct ArrowDeviceArray array;
    struct ArrowSchema schema;
    c_export_array(0, &array);
    c_export_schema(bad == 1, &schema);
    if (bad == 0) array.device_type = ARROW_DEVICE_METAL;
    int rc = devarrow_interop_device_import_check(device, 0, &array, &schema);
    CHECK(rc != 0, "devarrow accepted %s",
          bad == 0 ? "a Metal array" : "an array with a child less than its schema");
    CHECK(array.array.release == NULL && schema.release == NULL,
          "refused C array: devarrow did not move the structs");
    printf("3. devarrow refused %s (%d: %s); released once\n",
           bad == 0 ? "a Metal array" : "an array with a child less than its schema", rc,
           devarrow_interop_last_error());
    check_all_released("arrays devarrow refused");
  }
}

/* ---- 4. C's async producer -> devarrow's async consumer ---------------------------- */

#define MAX_TASKS 256

enum task_state { TASK_PENDING, TASK_EXTRACTED, TASK_DISCARDED, TASK_RECLAIMED };

struct c_task {
  struct c_producer* producer;
  struct ArrowDeviceArray array;
  int state;
};

struct c_producer {
  struct ArrowAsyncProducer producer; /* private_data: this struct */
  struct ArrowAsyncDeviceStreamHandler* handler;
  int n_batches; /* the end comes after these */
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  int64_t requested, total_requested;
  int bad_requests, cancel_calls, cancelled;
  int tasks; /* made */
  struct c_task task_data[MAX_TASKS];
  int extract_errors;
  int sent_end;
};

static void c_producer_request(struct ArrowAsyncProducer* self, int64_t n) {
  struct c_producer* p = self->private_data;
  pthread_mutex_lock(&p->mutex);
  if (n <= 0)
    p->bad_requests++;
  else if (!p->cancelled) {
    p->requested += n;
    p->total_requested += n;
  }
  pthread_cond_broadcast(&p->cond);
  pthread_mutex_unlock(&p->mutex);
}

static void c_producer_cancel(struct ArrowAsyncProducer* self) {
  struct c_producer* p = self->private_data;
  pthread_mutex_lock(&p->mutex);
  p->cancel_calls++;
  p->cancelled = 1;
  pthread_cond_broadcast(&p->cond);
  pthread_mutex_unlock(&p->mutex);
}

static int c_task_extract(struct ArrowAsyncTask* task, struct ArrowDeviceArray* out) {
  struct c_task* t = task->private_data;
  if (t == NULL) return EINVAL;
  struct c_producer* p = t->producer;
  pthread_mutex_lock(&p->mutex);
  int state = t->state;
  if (state == TASK_PENDING) t->state = out ? TASK_EXTRACTED : TASK_DISCARDED;
  else p->extract_errors++;
  pthread_mutex_unlock(&p->mutex);
  if (state != TASK_PENDING) return EINVAL;
  task->private_data = NULL;
  if (out) {
    *out = t->array; /* moved */
  } else {
    t->array.array.release(&t->array.array);
  }
  memset(&t->array, 0, sizeof t->array);
  return 0;
}

/* The producer's thread: schema, one task per requested unit, the end after n_batches
 * (without waiting for demand), release; stops as soon as it sees cancel. */
static void* c_producer_main(void* arg) {
  struct c_producer* p = arg;
  struct ArrowAsyncDeviceStreamHandler* handler = p->handler;
  if (g_cuda) CU(CtxSetCurrent(cu.context));
  handler->producer = &p->producer;
  struct ArrowSchema schema;
  c_export_schema(0, &schema);
  int rc = handler->on_schema(handler, &schema);
  CHECK(rc == 0, "C producer: on_schema returned %d", rc);
  CHECK(schema.release == NULL, "C producer: the consumer did not take the schema");
  for (int k = 0;; k++) {
    if (k == p->n_batches) {
      rc = handler->on_next_task(handler, NULL, NULL);
      CHECK(rc == 0, "C producer: the end task got %d", rc);
      p->sent_end = 1;
      break;
    }
    struct timespec deadline = deadline_in(60);
    pthread_mutex_lock(&p->mutex);
    while (!p->cancelled && p->requested == 0)
      CHECK(pthread_cond_timedwait(&p->cond, &p->mutex, &deadline) != ETIMEDOUT,
            "C producer: no request nor cancel for 60 s");
    int cancelled = p->cancelled;
    if (!cancelled) p->requested--;
    pthread_mutex_unlock(&p->mutex);
    if (cancelled) break;

    CHECK(p->tasks < MAX_TASKS, "C producer: too many tasks");
    struct c_task* t = &p->task_data[p->tasks++];
    t->producer = p;
    t->state = TASK_PENDING;
    c_export_array(k % 3, &t->array);
    struct ArrowAsyncTask task = {.extract_data = c_task_extract, .private_data = t};
    rc = handler->on_next_task(handler, &task, NULL);
    if (rc != 0) {
      /* Refused: still ours. */
      pthread_mutex_lock(&p->mutex);
      int state = t->state;
      t->state = TASK_RECLAIMED;
      pthread_mutex_unlock(&p->mutex);
      if (state == TASK_PENDING) t->array.array.release(&t->array.array);
      break;
    }
  }
  handler->release(handler);
  return NULL;
}

static void produce_async_for_devarrow(struct DevarrowInteropDevice* device,
                                       int n_batches, int take) {
  struct c_producer* p = calloc(1, sizeof *p);
  CHECK(p, "out of memory");
  pthread_mutex_init(&p->mutex, NULL);
  pthread_cond_init(&p->cond, NULL);
  p->n_batches = n_batches;
  p->producer = (struct ArrowAsyncProducer){
      .device_type = g_cuda ? ARROW_DEVICE_CUDA : ARROW_DEVICE_CPU,
      .request = c_producer_request, .cancel = c_producer_cancel,
      .additional_metadata = NULL, .private_data = p};
  struct DevarrowInteropAsyncConsumer* consumer;
  DEVARROW(devarrow_interop_device_async_consumer_new(device, 2, &consumer, &p->handler));
  pthread_t thread;
  CHECK(pthread_create(&thread, NULL, c_producer_main, p) == 0, "pthread_create");
  DEVARROW(devarrow_interop_device_async_consumer_read(consumer, take, n_batches));
  CHECK(pthread_join(thread, NULL) == 0, "pthread_join");

  int reclaimed = 0, discarded = 0;
  for (int i = 0; i < p->tasks; i++) {
    CHECK(p->task_data[i].state != TASK_PENDING, "C producer: task %d never extracted",
          i);
    reclaimed += p->task_data[i].state == TASK_RECLAIMED;
    discarded += p->task_data[i].state == TASK_DISCARDED;
  }
  CHECK(p->bad_requests == 0, "C producer: %d requests of n <= 0", p->bad_requests);
  CHECK(p->extract_errors == 0, "C producer: %d extractions of a task already extracted",
        p->extract_errors);
  CHECK(reclaimed == 0, "C producer: devarrow refused %d tasks", reclaimed);
  CHECK(p->tasks <= p->total_requested, "C producer: %d tasks for %lld requested",
        p->tasks, (long long)p->total_requested);
  if (take < 0) {
    CHECK(p->sent_end && p->tasks == n_batches, "C producer: %d tasks, end sent %d",
          p->tasks, p->sent_end);
    CHECK(p->cancel_calls == 0, "C producer: cancelled %d times after the end",
          p->cancel_calls);
  } else {
    CHECK(!p->sent_end, "C producer: reached the end of %d batches, not cancelled",
          n_batches);
    CHECK(p->cancel_calls == 1, "C producer: cancel called %d times, expected once",
          p->cancel_calls);
  }
  check_all_released("C's async producer");
  if (take < 0)
    printf("4. C async producer -> devarrow: %d batches and the end read and checked; "
           "every array released once\n", n_batches);
  else
    printf("4. C async producer -> devarrow: devarrow read %d batches and cancelled; the "
           "producer stopped after %d tasks (%d discarded by devarrow with a NULL "
           "extract_data), %lld requested; cancel called once, every array released "
           "once\n", take, p->tasks, discarded, (long long)p->total_requested);
  pthread_mutex_destroy(&p->mutex);
  pthread_cond_destroy(&p->cond);
  free(p);
}

/* ---- 5. devarrow's async producer -> C's async consumer ---------------------------- */

#define C_CONSUMER_ERROR EBADMSG

struct c_consumer {
  struct ArrowAsyncDeviceStreamHandler handler;
  int fail_at; /* return C_CONSUMER_ERROR at this task (-1: never) */
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  int tasks, checked, end_seen, refused, calls_after_refusal, on_error_calls,
      release_calls;
};

static int c_on_schema(struct ArrowAsyncDeviceStreamHandler* self,
                       struct ArrowSchema* schema) {
  check_schema(schema, "devarrow's async producer");
  release_schema_elsewhere(schema, "devarrow's async producer");
  CHECK(self->producer, "devarrow's async producer: no producer at on_schema");
  CHECK(self->producer->device_type == (g_cuda ? ARROW_DEVICE_CUDA : ARROW_DEVICE_CPU),
        "devarrow's async producer: device type %d", (int)self->producer->device_type);
  self->producer->request(self->producer, 2);
  return 0;
}

static int c_on_next_task(struct ArrowAsyncDeviceStreamHandler* self,
                          struct ArrowAsyncTask* task, const char* metadata) {
  struct c_consumer* c = self->private_data;
  (void)metadata;
  if (c->refused) {
    c->calls_after_refusal++;
    return EINVAL;
  }
  if (task == NULL) {
    c->end_seen++;
    return 0;
  }
  int k = c->tasks++;
  if (k == c->fail_at) {
    c->refused = 1;
    return C_CONSUMER_ERROR; /* not extracted: the task stays devarrow's */
  }
  struct ArrowDeviceArray array;
  int rc = task->extract_data(task, &array);
  CHECK(rc == 0, "extract_data of devarrow's task %d: %d", k, rc);
  char what[64];
  snprintf(what, sizeof what, "devarrow's async array %d", k);
  /* Called on devarrow's producer thread: bind the context around the driver calls. */
  ctx_enter();
  check_array(&array, k % 2, what);
  ctx_leave();
  release_array_elsewhere(&array, what);
  c->checked++;
  self->producer->request(self->producer, 1);
  return 0;
}

static void c_on_error(struct ArrowAsyncDeviceStreamHandler* self, int code,
                       const char* message, const char* metadata) {
  struct c_consumer* c = self->private_data;
  (void)metadata;
  printf("devarrow's async producer called on_error(%d, %s)\n", code,
         message ? message : "(null)");
  c->on_error_calls++;
}

static void c_release(struct ArrowAsyncDeviceStreamHandler* self) {
  struct c_consumer* c = self->private_data;
  pthread_mutex_lock(&c->mutex);
  c->release_calls++;
  pthread_cond_broadcast(&c->cond);
  pthread_mutex_unlock(&c->mutex);
}

static void consume_devarrow_async(struct DevarrowInteropDevice* device, int n_batches,
                                   int fail_at) {
  struct c_consumer* c = calloc(1, sizeof *c);
  CHECK(c, "out of memory");
  pthread_mutex_init(&c->mutex, NULL);
  pthread_cond_init(&c->cond, NULL);
  c->fail_at = fail_at;
  c->handler = (struct ArrowAsyncDeviceStreamHandler){
      .on_schema = c_on_schema, .on_next_task = c_on_next_task, .on_error = c_on_error,
      .release = c_release, .producer = NULL, .private_data = c};
  struct DevarrowInteropAsyncProducer* producer;
  DEVARROW(
      devarrow_interop_device_async_produce(device, n_batches, &c->handler, &producer));

  struct timespec deadline = deadline_in(60);
  pthread_mutex_lock(&c->mutex);
  while (c->release_calls == 0)
    CHECK(pthread_cond_timedwait(&c->cond, &c->mutex, &deadline) != ETIMEDOUT,
          "devarrow's async producer did not release the handler within 60 s");
  pthread_mutex_unlock(&c->mutex);

  int arrays = 0;
  DEVARROW(devarrow_interop_device_async_produce_finish(
      producer, fail_at < 0 ? 0 : C_CONSUMER_ERROR, &arrays));
  /* A late callback would come before the driver thread ends, which finish waited for. */
  CHECK(c->release_calls == 1, "devarrow released the handler %d times",
        c->release_calls);
  CHECK(c->on_error_calls == 0, "devarrow called on_error %d times", c->on_error_calls);
  CHECK(c->calls_after_refusal == 0, "devarrow called on_next_task %d times after the "
        "refusal", c->calls_after_refusal);
  if (fail_at < 0) {
    CHECK(c->checked == n_batches && c->end_seen == 1, "devarrow's async producer: %d of "
          "%d batches, end seen %d times", c->checked, n_batches, c->end_seen);
    printf("5. devarrow async producer -> C: %d batches checked, the end, release; %d "
           "arrays, each released once\n", c->checked, arrays);
  } else {
    CHECK(c->checked == fail_at && c->end_seen == 0, "devarrow's async producer: %d "
          "batches checked (expected %d), end seen %d times", c->checked, fail_at,
          c->end_seen);
    printf("5. devarrow async producer -> C refusing task %d with %d: %d batches "
           "checked, then only release; devarrow dropped its source, and its %d arrays "
           "(those C extracted, those it held) were each released once\n",
           fail_at, C_CONSUMER_ERROR, c->checked, arrays);
  }
  pthread_mutex_destroy(&c->mutex);
  pthread_cond_destroy(&c->cond);
  free(c);
}

/* ---- main ------------------------------------------------------------------------- */

int main(int argc, char** argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc != 2 || (strcmp(argv[1], "cpu") != 0 && strcmp(argv[1], "cuda") != 0)) {
    fprintf(stderr, "usage: %s cpu|cuda\n", argv[0]);
    return 2;
  }
  g_cuda = strcmp(argv[1], "cuda") == 0;
  if (g_cuda) cu_load();

  struct DevarrowInteropDevice* device;
  DEVARROW(devarrow_interop_open(g_cuda, &device));
  printf("devarrow device: %s\n", devarrow_interop_device_describe(device));

  consume_devarrow_arrays(device);
  consume_devarrow_stream(device);
  produce_arrays_for_devarrow(device);
  produce_async_for_devarrow(device, 4, -1);
  produce_async_for_devarrow(device, 100, 3);
  consume_devarrow_async(device, 4, -1);
  consume_devarrow_async(device, 8, 3);

  devarrow_interop_close(device);
  if (g_cuda) {
    CU(StreamSynchronize(g_stream));
    CU(StreamDestroy(g_stream));
    CU(DevicePrimaryCtxRelease(cu.device));
  }
  check_all_released("at the end");
  printf("all checks passed on %s: %d C arrays exported, each released once\n",
         g_cuda ? "CUDA" : "the CPU device", g_exports);
  return 0;
}
