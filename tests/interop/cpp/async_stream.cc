// devarrow's async device stream against Arrow C++ (pyarrow's libarrow), both ways.
//
// Built and run by tests/arrow_cpp.rs: g++ against the pyarrow wheel's headers and
// libarrow, linked with libdevarrow_interop.so (tests/interop/src/async_capi.rs).
//
// * Arrow C++ consumes devarrow's producer: arrow::CreateAsyncDeviceStreamHandler with its
//   default queue size (5) is handed to devarrow_interop_async_produce_samples; every
//   batch is compared (values, schema metadata) with the same sample exported by devarrow
//   as a device array and imported by Arrow C++; the per-batch metadata of each task and
//   the stream-level ArrowAsyncProducer.additional_metadata (row and batch counts) are
//   checked too. Arrow C++'s consumer calls request(1) on the producer for tasks still
//   queued after the handler's release: this is the case that used to crash.
// * devarrow consumes Arrow C++'s producer: arrow::ExportAsyncRecordBatchReader drives a
//   handler from devarrow_interop_async_consumer_new; devarrow compares every batch with
//   its samples (devarrow_interop_async_consumer_check), to the end or cancelling early.
//
// Prints one line per case ("ok <case>" / "FAIL <case>: <why>"); exits 1 if any failed.

#include <cstdint>
#include <cstring>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <arrow/c/abi.h>
#include <arrow/c/bridge.h>
#include <arrow/record_batch.h>
#include <arrow/status.h>
#include <arrow/util/async_generator.h>
#include <arrow/util/future.h>
#include <arrow/util/key_value_metadata.h>
#include <arrow/util/thread_pool.h>

struct DevarrowAsyncConsumer;

extern "C" {
int devarrow_interop_sample_count(void);
const char* devarrow_interop_last_error(void);
int devarrow_interop_export_sample(int which, struct ArrowDeviceArray* out,
                                   struct ArrowSchema* out_schema);
int devarrow_interop_async_produce_samples(struct ArrowAsyncDeviceStreamHandler* handler,
                                           int n_batches);
int devarrow_interop_async_consumer_new(int64_t capacity, DevarrowAsyncConsumer** out,
                                        struct ArrowAsyncDeviceStreamHandler** out_handler);
int devarrow_interop_async_consumer_check(DevarrowAsyncConsumer* consumer, int n_batches,
                                          int take);
}

namespace {

struct Failure {
  std::string what;
};

#define CHECK(cond, msg)                                              \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::ostringstream _s;                                          \
      _s << __LINE__ << ": " << msg;                                  \
      throw Failure{_s.str()};                                        \
    }                                                                 \
  } while (0)

#define CHECK_OK(expr)                                                   \
  do {                                                                   \
    ::arrow::Status _st = (expr);                                        \
    CHECK(_st.ok(), #expr << " failed: " << _st.ToString());             \
  } while (0)

template <typename T>
T ValueOrFail(arrow::Result<T> result, const char* what) {
  CHECK(result.ok(), what << " failed: " << result.status().ToString());
  return result.MoveValueUnsafe();
}

void CheckRc(int rc, const char* what) {
  CHECK(rc == 0, what << " returned " << rc << ": " << devarrow_interop_last_error());
}

// Sample `which` as exported by devarrow (device array + schema), imported by Arrow C++.
std::shared_ptr<arrow::RecordBatch> Sample(int which) {
  struct ArrowDeviceArray array;
  struct ArrowSchema schema;
  CheckRc(devarrow_interop_export_sample(which, &array, &schema),
          "devarrow_interop_export_sample");
  return ValueOrFail(arrow::ImportDeviceRecordBatch(&array, &schema),
                     "ImportDeviceRecordBatch");
}

std::shared_ptr<arrow::RecordBatch> CycledSample(int i) {
  return Sample(i % devarrow_interop_sample_count());
}

// Decodes metadata in the ArrowSchema.metadata format: int32 count, then per pair an
// int32 length and the key's bytes, an int32 length and the value's bytes.
std::map<std::string, std::string> DecodeMetadata(const char* encoded) {
  std::map<std::string, std::string> out;
  if (encoded == nullptr) return out;
  auto read_i32 = [&encoded]() {
    int32_t v;
    std::memcpy(&v, encoded, sizeof v);
    encoded += sizeof v;
    return v;
  };
  int32_t n = read_i32();
  for (int32_t k = 0; k < n; ++k) {
    int32_t key_len = read_i32();
    std::string key(encoded, key_len);
    encoded += key_len;
    int32_t value_len = read_i32();
    std::string value(encoded, value_len);
    encoded += value_len;
    out[key] = value;
  }
  return out;
}

// What the devarrow producer's additional_metadata said, read in on_schema (when the
// producer is certainly alive) by a wrapper around Arrow C++'s own on_schema.
struct SeenOnSchema {
  bool called = false;
  bool producer_set = false;
  std::map<std::string, std::string> additional_metadata;
};
SeenOnSchema g_seen;
int (*g_arrow_on_schema)(struct ArrowAsyncDeviceStreamHandler*, struct ArrowSchema*) = nullptr;

int WrappedOnSchema(struct ArrowAsyncDeviceStreamHandler* self, struct ArrowSchema* schema) {
  g_seen.called = true;
  g_seen.producer_set = self->producer != nullptr;
  if (self->producer != nullptr) {
    g_seen.additional_metadata = DecodeMetadata(self->producer->additional_metadata);
  }
  return g_arrow_on_schema(self, schema);
}

// Arrow C++ consumes devarrow's producer, with CreateAsyncDeviceStreamHandler's default
// queue size.
void ArrowCppConsumesDevarrowProducer(int n_batches) {
  g_seen = SeenOnSchema{};
  // The handler must outlive the producer's use of it (until its release): static
  // storage, reused by the cases one after the other (each waits for the end).
  static struct ArrowAsyncDeviceStreamHandler handler;
  std::memset(&handler, 0, sizeof handler);
  auto fut = arrow::CreateAsyncDeviceStreamHandler(&handler,
                                                   arrow::internal::GetCpuThreadPool());
  g_arrow_on_schema = handler.on_schema;
  handler.on_schema = WrappedOnSchema;
  CheckRc(devarrow_interop_async_produce_samples(&handler, n_batches),
          "devarrow_interop_async_produce_samples");
  auto gen = ValueOrFail(fut.result(), "CreateAsyncDeviceStreamHandler's future");
  CHECK(g_seen.called && g_seen.producer_set, "on_schema without a producer");
  CHECK(gen.device_type == arrow::DeviceAllocationType::kCPU,
        "device type " << static_cast<int>(gen.device_type));
  auto expected_schema = Sample(0)->schema();
  CHECK(gen.schema->Equals(*expected_schema, /*check_metadata=*/true),
        "schema " << gen.schema->ToString(true) << "\nexpected "
                  << expected_schema->ToString(true));

  int64_t rows = 0;
  int got = 0;
  for (;;) {
    auto item = ValueOrFail(gen.generator().result(), "the generator");
    if (arrow::IsIterationEnd(item)) break;
    CHECK(got < n_batches, "more than the " << n_batches << " batches produced");
    auto expected = CycledSample(got);
    CHECK(item.batch->Equals(*expected, /*check_metadata=*/true),
          "batch " << got << ":\n"
                   << item.batch->ToString() << "\nexpected\n"
                   << expected->ToString());
    CHECK(item.batch->schema()->Equals(*expected->schema(), /*check_metadata=*/true),
          "batch " << got << " schema");
    // devarrow's interop producer tags each task with its index.
    CHECK(item.custom_metadata != nullptr, "batch " << got << " without metadata");
    auto index = item.custom_metadata->Get("devarrow.interop.batch");
    CHECK(index.ok() && *index == std::to_string(got),
          "batch " << got << " metadata " << item.custom_metadata->ToString());
    rows += item.batch->num_rows();
    ++got;
  }
  CHECK(got == n_batches, got << " batches, expected " << n_batches);
  // The generator stays ended.
  auto again = ValueOrFail(gen.generator().result(), "the generator after the end");
  CHECK(arrow::IsIterationEnd(again), "a batch after the end");

  // Stream-level facts, known to the producer (it streams a fixed list of batches).
  auto& meta = g_seen.additional_metadata;
  CHECK(meta.count("devarrow.num_batches") && meta["devarrow.num_batches"] ==
                                                  std::to_string(n_batches),
        "additional_metadata num_batches");
  CHECK(meta.count("devarrow.num_rows") && meta["devarrow.num_rows"] == std::to_string(rows),
        "additional_metadata num_rows");
}

// devarrow consumes Arrow C++'s producer (ExportAsyncRecordBatchReader), reading to the
// end (take < 0) or dropping its stream after `take` batches (which cancels the producer).
void DevarrowConsumesArrowCppProducer(int n_batches, int64_t capacity, int take) {
  std::vector<std::shared_ptr<arrow::RecordBatch>> batches;
  for (int i = 0; i < n_batches; ++i) batches.push_back(CycledSample(i));
  auto schema = Sample(0)->schema();

  DevarrowAsyncConsumer* consumer = nullptr;
  struct ArrowAsyncDeviceStreamHandler* handler = nullptr;
  CheckRc(devarrow_interop_async_consumer_new(capacity, &consumer, &handler),
          "devarrow_interop_async_consumer_new");

  // ExportAsyncRecordBatchReader calls on_schema, then serves each batch once requested,
  // blocking its thread while there is no demand: run it on a thread of its own.
  arrow::Status exported;
  std::thread producer([&] {
    exported = arrow::ExportAsyncRecordBatchReader(
                   schema, arrow::MakeVectorGenerator(batches),
                   arrow::DeviceAllocationType::kCPU, handler)
                   .status();
  });
  int rc = devarrow_interop_async_consumer_check(consumer, n_batches, take);
  std::string why = rc == 0 ? "" : devarrow_interop_last_error();
  producer.join();
  CHECK(rc == 0, "devarrow_interop_async_consumer_check returned " << rc << ": " << why);
  if (take < 0 || take >= n_batches) {
    CHECK(exported.ok(), "ExportAsyncRecordBatchReader: " << exported.ToString());
  } else {
    // Cancelled by the consumer: Arrow C++ reports it as an error status.
    CHECK(!exported.ok(), "ExportAsyncRecordBatchReader was not cancelled");
  }
}

}  // namespace

int main() {
  int failed = 0;
  auto run_case = [&failed](const std::string& name, const std::function<void()>& f) {
    try {
      f();
      std::cout << "ok " << name << std::endl;
    } catch (const Failure& e) {
      std::cout << "FAIL " << name << ": " << e.what << std::endl;
      ++failed;
    }
  };

  for (int n : {0, 1, 3, 12}) {
    run_case("arrow_cpp_consumes_devarrow_producer_" + std::to_string(n) + "_batches",
             [n] { ArrowCppConsumesDevarrowProducer(n); });
  }
  struct Case {
    int n_batches;
    int64_t capacity;
    int take;
  };
  for (Case c : {Case{3, 1, -1}, Case{12, 5, -1}, Case{0, 2, -1}, Case{12, 2, 4}}) {
    std::ostringstream name;
    name << "devarrow_consumes_arrow_cpp_producer_" << c.n_batches << "_batches_capacity_"
         << c.capacity;
    if (c.take >= 0) name << "_cancel_after_" << c.take;
    run_case(name.str(),
             [c] { DevarrowConsumesArrowCppProducer(c.n_batches, c.capacity, c.take); });
  }
  std::cout << (failed == 0 ? "all passed" : "some failed") << std::endl;
  return failed == 0 ? 0 : 1;
}
