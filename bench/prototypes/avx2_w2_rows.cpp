// Ad hoc prototype (not built by the package; numbers in docs/benchmarks.md, "Two loops that did not pay"): the
// batch-1 2-bit x int8 loop of csrc/kernels/q4_int8.cpp's AVX2 path at group 64 (`cur`: each row's 16 bytes broadcast,
// two variable shifts, two masks) against two rows per 32-byte load (`lane`: 128-bit lane = row, three shifts and
// four masks, the x quarters broadcast, the two blocks' int16 sums merged by one vphaddw before a single
// vpmaddwd), alternating calls, median thread CPU time; prints the largest relative difference of the two outputs.
//   g++ -O3 -mavx2 -mfma -mf16c -o avx2_w2_rows avx2_w2_rows.cpp && ./avx2_w2_rows N K COPIES
#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <ctime>
#include <algorithm>
#include <cmath>
static double cpu_us(){timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t); return t.tv_sec*1e6+t.tv_nsec/1e3;}
constexpr int G=64;
static inline float hsum8(__m256 v){__m128 a=_mm_add_ps(_mm256_castps256_ps128(v),_mm256_extractf128_ps(v,1)); a=_mm_hadd_ps(a,a); a=_mm_hadd_ps(a,a); return _mm_cvtss_f32(a);}
// w: [tiles][K/64][4 rows][16 B]; s: [tiles][groups][4]; xi chunk order (0-15,32-47,16-31,48-63); dpair [K/64][8]
__attribute__((target("avx2,fma")))
void cur(const uint8_t* w, const float* s, int N, int K, const int8_t* xi, const float* dpair, float* y){
  const int pairs=K/64;
  const __m256i mask=_mm256_set1_epi8(3), ones=_mm256_set1_epi16(1);
  const __m256i sl=_mm256_setr_epi32(0,0,0,0,4,4,4,4), sh=_mm256_setr_epi32(2,2,2,2,6,6,6,6);
  for(int i=0;i<N/4;i++){
    const uint8_t* wt=w+(size_t)i*pairs*64; const float* st=s+(size_t)i*pairs*4;
    __m256 total[4]; for(int r=0;r<4;r++) total[r]=_mm256_setzero_ps();
    for(int p=0;p<pairs;p++){ // g64: group = chunk
      __m256i xl=_mm256_loadu_si256((const __m256i*)(xi+p*64)), xh=_mm256_loadu_si256((const __m256i*)(xi+p*64+32));
      __m256 d=_mm256_loadu_ps(dpair+p*8);
      for(int r=0;r<4;r++){
        __m256i v=_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(wt+(p*4+r)*16)));
        __m256i lo=_mm256_and_si256(_mm256_srlv_epi32(v,sl),mask), hi=_mm256_and_si256(_mm256_srlv_epi32(v,sh),mask);
        __m256i pr=_mm256_add_epi16(_mm256_maddubs_epi16(lo,xl),_mm256_maddubs_epi16(hi,xh));
        __m256 acc=_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pr,ones)),d);
        total[r]=_mm256_fmadd_ps(acc,_mm256_broadcast_ss(st+p*4+r),total[r]);
      }
    }
    for(int r=0;r<4;r++) y[i*4+r]=hsum8(total[r]);
  }
}
// rows 2j, 2j+1 in one 32-byte load (lane = row); quarters of x broadcast; hadd merges the two blocks
__attribute__((target("avx2,fma")))
void lane(const uint8_t* w, const float* s8, int N, int K, const int8_t* xi, const float* dpair, float* y){
  const int pairs=K/64;
  const __m256i mask=_mm256_set1_epi8(3), ones=_mm256_set1_epi16(1);
  for(int i=0;i<N/4;i++){
    const uint8_t* wt=w+(size_t)i*pairs*64; const float* st=s8+(size_t)i*pairs*16;
    __m256 total[2]={_mm256_setzero_ps(),_mm256_setzero_ps()};
    for(int p=0;p<pairs;p++){
      const int8_t* x=xi+p*64;
      __m256i q0=_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(x))); // cols 0-15
      __m256i q1=_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(x+32))); // 16-31
      __m256i q2=_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(x+16))); // 32-47
      __m256i q3=_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(x+48))); // 48-63
      // d as [d0,d0,d1,d1] per lane
      __m256 d=_mm256_set_m128(_mm_setr_ps(dpair[p*8],dpair[p*8],dpair[p*8+4],dpair[p*8+4]),_mm_setr_ps(dpair[p*8],dpair[p*8],dpair[p*8+4],dpair[p*8+4]));
      for(int j=0;j<2;j++){
        __m256i v=_mm256_loadu_si256((const __m256i*)(wt+(p*4+2*j)*16));
        __m256i b0=_mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v,mask),q0),_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v,2),mask),q1));
        __m256i b1=_mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v,4),mask),q2),_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v,6),mask),q3));
        __m256i h=_mm256_madd_epi16(_mm256_hadd_epi16(b0,b1),ones);
        __m256 acc=_mm256_mul_ps(_mm256_cvtepi32_ps(h),d);
        total[j]=_mm256_fmadd_ps(acc,_mm256_loadu_ps(st+p*16+8*j),total[j]);
      }
    }
    for(int j=0;j<2;j++){ __m128 a=_mm256_castps256_ps128(total[j]), b=_mm256_extractf128_ps(total[j],1);
      a=_mm_hadd_ps(a,a); a=_mm_hadd_ps(a,a); b=_mm_hadd_ps(b,b); b=_mm_hadd_ps(b,b);
      y[i*4+2*j]=_mm_cvtss_f32(a); y[i*4+2*j+1]=_mm_cvtss_f32(b);}
  }
}
int main(int argc,char**argv){
  int N=atoi(argv[1]),K=atoi(argv[2]); int copies=atoi(argv[3]);
  size_t wb=(size_t)N*K/4;
  std::vector<std::vector<uint8_t>> W(copies,std::vector<uint8_t>(wb));
  for(auto&v:W) for(auto&b:v) b=rand();
  std::vector<float> s(N/4*(K/G)*4,0.01f), s8(N/4*(K/G)*16,0.01f), dp(K/64*8,0.1f), y(N), y2(N);
  std::vector<int8_t> xi(K); for(auto&b:xi) b=rand()%255-127;
  int reps=400; std::vector<double> A,B;
  for(int r=0;r<reps;r++){
    double t0=cpu_us(); cur(W[r%copies].data(),s.data(),N,K,xi.data(),dp.data(),y.data()); double t1=cpu_us();
    lane(W[(r+copies/2)%copies].data(),s8.data(),N,K,xi.data(),dp.data(),y2.data()); double t2=cpu_us();
    A.push_back(t1-t0); B.push_back(t2-t1);
  }
  if(copies==1){ double m=0; for(int i=0;i<N;i++) m=std::max(m,(double)fabsf(y[i]-y2[i])/(fabsf(y[i])+1e-3)); printf("max rel diff %.2e\n",m);}
  std::sort(A.begin(),A.end()); std::sort(B.begin(),B.end());
  printf("%dx%d copies %d: cur %.1f us (%.1f Gc/s)  lane %.1f us (%.1f Gc/s)  ratio %.2f\n",N,K,copies,A[reps/2],N*(double)K/A[reps/2]/1e3,B[reps/2],N*(double)K/B[reps/2]/1e3,A[reps/2]/B[reps/2]);
}
